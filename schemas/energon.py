"""Energon's files in a packed directory: their names, and readers both stages use.

`prep energon-index` writes them with Energon's own API (plus ``dataset.yaml``); `train` and
`prep energon-blend` read them back::

    OUT/.nv-meta/dataset.yaml    CrudeWebdataset + our subflavors (`schemas.packed.PACK_SUBFLAVORS`)
    OUT/.nv-meta/split.yaml      split_parts: {train: [shards/shard-{000000..000001}.tar], val: [...], test: []}
    OUT/.nv-meta/.info.json      {"energon_version": ..., "shard_counts": {"shards/shard-000000.tar": 4, ...}}
    OUT/.nv-meta/index.sqlite    random access by key (`train.preflight`, `energon mount`)
    OUT/shards/*.tar.idx         one per shard

The names are Energon's (``megatron.energon.flavors.webdataset.config``; Energon has no
constant for ``dataset.yaml``), spelled here so that reading a name costs no Energon import
(it pulls in torch); `tests/schemas/test_contracts.py` holds them equal to Energon's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packvlm.errors import UsageError
from schemas.layout import MANIFEST_FILE
from schemas.packed import PACK_SUBFLAVORS, PACKED_SCHEMA_VERSION, PackedOutput, read_packed_output

META_DIR = ".nv-meta"  # MAIN_FOLDER_NAME
DATASET_YAML = "dataset.yaml"
SPLIT_YAML = "split.yaml"  # SPLIT_YAML_FILENAME
INFO_JSON = ".info.json"  # INFO_JSON_FILENAME
INDEX_SQLITE = "index.sqlite"  # INDEX_SQLITE_FILENAME
INDEX_SUFFIX = ".idx"  # beside each shard: shards/shard-000000.tar.idx


class EnergonIndexError(UsageError):
    """DIR is not a finished `prep pack` output, or a split option is unusable or cannot be honoured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexResult:
    """What Energon indexed: samples per shard and shards per split."""

    shard_counts: dict[str, int]
    splits: dict[str, list[str]]
    wanted: tuple[int, ...] | None = None  # packs per split a --split-ratio asked for

    def packs_per_split(self) -> dict[str, int]:
        return {name: sum(self.shard_counts[p] for p in parts) for name, parts in self.splits.items()}


def dataset_definition() -> dict[str, Any]:
    """``dataset.yaml`` content: what `energon prepare` writes for CrudeWebdataset, plus our subflavors.

    Energon hands the subflavors to the cooker with every sample (``__subflavors__``); the cooker
    matches on ``format``, `train` checks ``format_version``. Version 2 also carried ``pack_size``
    (never read: the pack manifest's is the one copy).
    """
    return {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
        "subflavors": {**PACK_SUBFLAVORS, "format_version": PACKED_SCHEMA_VERSION},
    }


def read_packed_dir(root: Path) -> PackedOutput:
    """The packed directory's manifests, its shards checked to exist and to be at least one.

    Raises:
        EnergonIndexError: No pack manifest, or a plan with no shards.
        ManifestError: A manifest of another stage or version, or shards missing / from
            another plan (`schemas.packed.IncompleteShardsError`).
    """
    if not (root / MANIFEST_FILE).is_file():
        raise EnergonIndexError(f"{root} has no {MANIFEST_FILE}: run `prep pack --output {root}` first")
    packed = read_packed_output(root)
    if not packed.shards.shards:
        raise EnergonIndexError(f"{root}: the pack run wrote no shards (every sample oversize?); nothing to index")
    return packed


def read_index(root: Path) -> IndexResult:
    """Shard counts and split parts as Energon wrote them (brace ranges expanded)."""
    import braceexpand

    info = json.loads((root / META_DIR / INFO_JSON).read_text(encoding="utf-8"))
    split = yaml.safe_load((root / META_DIR / SPLIT_YAML).read_text(encoding="utf-8"))
    splits = {
        name: [p for pattern in parts for p in braceexpand.braceexpand(pattern)]
        for name, parts in split["split_parts"].items()
    }
    return IndexResult(shard_counts=dict(info["shard_counts"]), splits=splits)
