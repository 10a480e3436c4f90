"""`prep energon-index` stage: make a `prep pack` directory an Energon dataset.

Inputs: ``DIR``, a complete packed directory: ``manifest.json`` (`PackManifest`) and
``shards.json`` (`ShardsManifest`) with the shards it lists (`schemas.packed.read_packed_output`).
Outputs (Energon's own files, written by Energon's API): ``DIR/.nv-meta/{split.yaml,
.info.json, index.sqlite, index.uuid}``, ``DIR/shards/*.tar.idx``, and
``DIR/.nv-meta/dataset.yaml`` declaring a ``CrudeWebdataset`` with our subflavors, in the
form ``energon prepare --sample-type CrudeWebdataset`` writes.

Invariants: only the shards ``shards.json`` lists are indexed (never stray temp files);
``verify_dataset`` loads the result with ``get_train_dataset`` and requires every pack
back exactly once, cooked without error.

Example: 3 shards, ``--split-ratio 1,0,0`` -> split.yaml ``train: [shards/shard-{000000..000002}.tar]``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packvlm.atomic import write_bytes_atomic
from schemas.layout import MANIFEST_FILE
from schemas.manifest import PackManifest
from schemas.packed import PACK_SUBFLAVORS, PACKED_SCHEMA_VERSION, PackedOutput, read_packed_output

log = logging.getLogger(__name__)
META_DIR = ".nv-meta"  # megatron.energon.flavors.webdataset.config.MAIN_FOLDER_NAME
DATASET_YAML = "dataset.yaml"
SPLIT_NAMES = ("train", "val", "test")


class EnergonIndexError(RuntimeError):
    """DIR is not a finished `prep pack` output, or a split option is unusable."""


class EnergonVerifyError(RuntimeError):
    """Loading the dataset with Energon did not give every pack exactly once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexResult:
    """What Energon indexed: samples per shard and shards per split."""

    shard_counts: dict[str, int]
    splits: dict[str, list[str]]


def parse_split_ratio(text: str) -> list[tuple[str, float]]:
    """``"0.9,0.1,0"`` -> [("train", 0.9), ("val", 0.1), ("test", 0.0)]."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError as exc:
        raise EnergonIndexError(f"--split-ratio {text!r}: use three numbers like 1,0,0") from exc
    if len(values) != 3 or min(values) < 0 or values[0] <= 0:
        raise EnergonIndexError(f"--split-ratio {text!r}: need train,val,test >= 0 with train > 0")
    return list(zip(SPLIT_NAMES, values))


def parse_split_patterns(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """``("train:shards/shard-0000[0-8].*", ...)`` -> [(split, regex), ...]."""
    out = []
    for item in items:
        split, sep, pattern = item.partition(":")
        if not sep or not split or not pattern:
            raise EnergonIndexError(f"--split-pattern {item!r}: use SPLIT:REGEX, e.g. 'val:shards/shard-000000.tar'")
        out.append((split, pattern))
    return out


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


def dataset_definition(manifest: PackManifest) -> dict[str, Any]:
    """``dataset.yaml`` content: what `energon prepare` writes for CrudeWebdataset, + subflavors."""
    return {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
        "subflavors": {
            **PACK_SUBFLAVORS,
            "format_version": PACKED_SCHEMA_VERSION,
            "pack_size": manifest.pack_size,
        },
    }


def index_dataset(
    root: str | Path,
    *,
    split_ratio: list[tuple[str, float]] | None = None,
    split_patterns: list[tuple[str, str]] | None = None,
    workers: int = 2,
) -> IndexResult:
    """Index the shards with `BaseWebdatasetFactory.prepare_dataset` and write dataset.yaml."""
    from megatron.energon.flavors import BaseWebdatasetFactory

    root = Path(root).resolve()
    packed = read_packed_dir(root)
    shards = [s.name for s in packed.shards.shards]
    if split_patterns is None:
        split_ratio = split_ratio or [("train", 1.0), ("val", 0.0), ("test", 0.0)]
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):  # Energon prints progress; keep our stdout ours
        BaseWebdatasetFactory.prepare_dataset(
            root,
            shards,
            split_parts_ratio=None if split_patterns else split_ratio,
            split_parts_patterns=split_patterns,
            workers=max(1, min(workers, len(shards))),
        )
    log.debug("energon prepare: %s", chatter.getvalue().strip())
    definition = yaml.dump(dataset_definition(packed.manifest), sort_keys=False)
    write_bytes_atomic(root / META_DIR / DATASET_YAML, definition.encode("utf-8"))
    return read_index(root)


def read_index(root: Path) -> IndexResult:
    """Shard counts and split parts as Energon wrote them (brace ranges expanded)."""
    import json

    import braceexpand

    info = json.loads((root / META_DIR / ".info.json").read_text(encoding="utf-8"))
    split = yaml.safe_load((root / META_DIR / "split.yaml").read_text(encoding="utf-8"))
    splits = {
        name: [p for pattern in parts for p in braceexpand.braceexpand(pattern)]
        for name, parts in split["split_parts"].items()
    }
    return IndexResult(shard_counts=dict(info["shard_counts"]), splits=splits)


def verify_dataset(root: str | Path, num_workers: int = 0) -> dict[str, int]:
    """Load every non-empty split with Energon (repeat=False) and check each pack comes once.

    Returns:
        Packs loaded per split.

    Raises:
        EnergonVerifyError: A pack is missing, repeated or unknown.
    """
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from packvlm.energon import PackedTaskEncoder

    root = Path(root).resolve()
    expected = read_packed_dir(root).manifest.packs.packs
    index = read_index(root)
    loaded: Counter[str] = Counter()
    per_split = {}
    for split, parts in index.splits.items():
        if not parts:
            continue
        worker_config = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
        ds = get_train_dataset(
            root,
            split_part=split,
            worker_config=worker_config,
            batch_size=None,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
            task_encoder=PackedTaskEncoder(),
        )
        keys = [sample.__key__ for sample in get_loader(ds)]
        loaded.update(keys)
        per_split[split] = len(keys)
    repeated = [k for k, c in loaded.items() if c > 1]
    if repeated or len(loaded) != expected:
        raise EnergonVerifyError(f"Energon loaded {len(loaded)} distinct packs of {expected}; repeated {repeated[:5]}")
    return per_split
