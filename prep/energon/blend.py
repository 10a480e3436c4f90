"""`prep energon-blend`: a MetadatasetV2 YAML blending prepared datasets by weight.

Output (paths relative to the YAML's folder, so the blend moves with its datasets)::

    __module__: megatron.energon
    __class__: MetadatasetV2
    splits:
      train:
        blend:
        - weight: 3.0
          path: ../packed/a
        - weight: 1.0
          path: ../packed/b

Each path must be a complete `prep pack` output made an Energon dataset by `prep energon-index`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packvlm.atomic import write_bytes_atomic
from schemas.energon import META_DIR, SPLIT_YAML, EnergonIndexError, read_packed_dir


@dataclass(frozen=True, kw_only=True, slots=True)
class BlendEntry:
    """One ``--blend PATH=WEIGHT``: an indexed dataset and its relative weight."""

    path: str
    weight: float


def parse_blend(item: str) -> BlendEntry:
    """``PATH=WEIGHT`` -> BlendEntry; the last ``=`` splits, so paths may hold ``=``."""
    path, sep, weight = item.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = -1.0
    if not sep or not path or not value > 0:
        raise EnergonIndexError(f"--blend {item!r}: use PATH=WEIGHT with WEIGHT > 0, e.g. ./a=3")
    return BlendEntry(path=path, weight=value)


def blend_definition(entries: list[BlendEntry], output: Path, split: str = "train") -> dict[str, Any]:
    """The MetadatasetV2 dict; every dataset must be a complete packed directory, indexed.

    Raises:
        EnergonIndexError: No entries, or a dataset without a pack manifest or Energon index.
        ManifestError: A dataset's manifests are of another stage/version or its shards incomplete.
    """
    if not entries:
        raise EnergonIndexError("give at least one --blend PATH=WEIGHT")
    base = output.resolve().parent
    blend = []
    for entry in entries:
        target = Path(entry.path).resolve()
        read_packed_dir(target)
        if not (target / META_DIR / SPLIT_YAML).is_file():
            raise EnergonIndexError(f"{target} is not an Energon dataset; run `prep energon-index {target}` first")
        blend.append({"weight": entry.weight, "path": os.path.relpath(target, base)})
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {split: {"blend": blend}}}


def write_blend(entries: list[BlendEntry], output: str | Path, split: str = "train") -> dict[str, Any]:
    """Write the blend YAML (temp + rename) and return its content."""
    output = Path(output)
    definition = blend_definition(entries, output, split)
    write_bytes_atomic(output, yaml.dump(definition, sort_keys=False).encode("utf-8"))
    return definition
