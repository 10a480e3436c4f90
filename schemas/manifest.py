"""The JSON manifest every stage writes beside its output (``manifest.json``).

A manifest is the stage's receipt: what ran (stage, config), on what (inputs and their
hashes, processor identity), with which libraries, and what came out (counts, totals).
It holds no timestamps so that the same input and config give a byte-identical file.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST_SCHEMA_VERSION = 1
TRACKED_LIBRARIES = ("packvlm", "transformers", "tokenizers", "pyarrow", "ray", "numpy", "pillow", "av")


def library_versions(names: tuple[str, ...] = TRACKED_LIBRARIES) -> dict[str, str]:
    """Installed versions of the libraries whose behaviour shapes a stage's output."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(stage: str, config: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """Assemble a manifest dict with the fields every stage shares."""
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "stage": stage,
        "config": config,
        "libraries": library_versions(),
        **sections,
    }


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> None:
    """Write JSON with sorted keys via temp file + rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_manifest(path: str | Path, stage: str | None = None) -> dict[str, Any]:
    """Load a manifest; ``stage`` checks it was written by the expected stage."""
    path = Path(path)
    payload = json.loads(path.read_text(encoding="utf-8"))
    if payload.get("schema_version") != MANIFEST_SCHEMA_VERSION:
        raise ValueError(f"{path}: manifest schema {payload.get('schema_version')} unsupported")
    if stage is not None and payload.get("stage") != stage:
        raise ValueError(f"{path}: written by stage {payload.get('stage')!r}, expected {stage!r}")
    return payload
