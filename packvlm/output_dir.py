"""Claiming a stage's output directory so reruns resume and foreign directories are refused.

A stage records the options its output depends on in ``_run.json`` before writing
anything else. A rerun with the same options resumes (half-written temp files of a killed
run are cleared); other options, or a non-empty directory without a run file, are refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from packvlm.atomic import clear_stale, write_json_atomic
from schemas.layout import RUN_FILE


def claim_output_dir(
    out: Path, fingerprint: dict[str, Any], subdirs: tuple[str, ...], command: str, conflict: type[Exception]
) -> None:
    """Create ``out`` and its ``subdirs`` for a run with ``fingerprint``; raise ``conflict`` if taken."""
    run_file = out / RUN_FILE
    record = {"command": command, **fingerprint}
    if out.exists() and any(out.iterdir()):
        if not run_file.is_file():
            raise conflict(f"{out} is not empty and holds no `{command}` run; choose an empty --output")
        previous = json.loads(run_file.read_text(encoding="utf-8"))
        if previous.get("command") != command:
            raise conflict(
                f"{out} holds a `{previous.get('command', 'another command')}` output; choose another --output"
            )
        if previous != record:
            changes = "; ".join(describe_changes(previous, record)[:5])
            raise conflict(
                f"{out} holds a `{command}` run that differs: {changes}; use a new --output, or the same "
                "options and inputs to resume"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_file, record)  # first, so a run killed from here on can resume
    for sub in subdirs:
        (out / sub).mkdir(exist_ok=True)
        clear_stale(out / sub)  # half-written files of a killed run


def describe_changes(old: Any, new: Any, where: str = "") -> list[str]:
    """Leaf-level differences between two JSON values, as ``path: old -> new`` lines."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            sub = f"{where}.{key}" if where else str(key)
            if key not in old:
                out.append(f"{sub}: (none) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{sub}: {old[key]!r} -> (none)")
            else:
                out.extend(describe_changes(old[key], new[key], sub))
        return out
    return [] if old == new else [f"{where or 'value'}: {old!r} -> {new!r}"]


def file_fingerprint(path: str | Path, block_bytes: int = 1 << 20) -> dict[str, Any]:
    """Size and a hash of the first and last ``block_bytes``: cheap on large files, catches edits and truncation."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(block_bytes))
        if size > block_bytes:
            fh.seek(max(block_bytes, size - block_bytes))
            digest.update(fh.read(block_bytes))
    return {"size": size, "head_tail_sha256": digest.hexdigest()}
