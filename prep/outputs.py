"""Claiming a stage's output directory so reruns resume and foreign directories are refused.

A stage records the options its output depends on in ``_run.json`` before writing
anything else. A rerun with the same options resumes (half-written temp files of a killed
run are cleared); other options, or a non-empty directory without a run file, are refused.
"""

from __future__ import annotations

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
    if out.exists() and any(out.iterdir()):
        if not run_file.is_file():
            raise conflict(f"{out} is not empty and holds no `{command}` run; choose an empty --output")
        previous = json.loads(run_file.read_text(encoding="utf-8"))
        if previous != fingerprint:
            raise conflict(
                f"{out} holds a `{command}` run with other options or inputs ({previous}); "
                "use a new --output or the same options to resume"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_file, fingerprint)  # first, so a run killed from here on can resume
    for sub in subdirs:
        (out / sub).mkdir(exist_ok=True)
        clear_stale(out / sub)  # half-written files of a killed run
