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

Each path must already be an Energon dataset (`prep energon-index`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from prep.energon.index import META_DIR, EnergonIndexError


@dataclass(frozen=True, kw_only=True, slots=True)
class BlendEntry:
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


def blend_definition(entries: list[BlendEntry], output: Path, split: str = "train") -> dict:
    """The MetadatasetV2 dict; every dataset must carry Energon's ``.nv-meta``."""
    if not entries:
        raise EnergonIndexError("give at least one --blend PATH=WEIGHT")
    base = output.resolve().parent
    blend = []
    for entry in entries:
        target = Path(entry.path).resolve()
        if not (target / META_DIR / "split.yaml").is_file():
            raise EnergonIndexError(f"{target} is not an Energon dataset; run `prep energon-index {target}` first")
        blend.append({"weight": entry.weight, "path": os.path.relpath(target, base)})
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {split: {"blend": blend}}}


def write_blend(entries: list[BlendEntry], output: str | Path, split: str = "train") -> dict:
    """Write the blend YAML (temp + rename) and return its content."""
    output = Path(output)
    definition = blend_definition(entries, output, split)
    tmp = output.with_name(f".tmp-{output.name}")
    tmp.write_text(yaml.dump(definition, sort_keys=False), encoding="utf-8")
    os.replace(tmp, output)
    return definition
