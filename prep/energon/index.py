"""`prep energon-index` stage: make a `prep pack` directory an Energon dataset.

Inputs: ``DIR``, a complete packed directory: ``manifest.json`` (`PackManifest`) and
``shards.json`` (`ShardsManifest`) with the shards it lists (`schemas.packed.read_packed_output`).
Outputs (Energon's own files, written by Energon's API): ``DIR/.nv-meta/{split.yaml,
.info.json, index.sqlite, index.uuid}``, ``DIR/shards/*.tar.idx``, and
``DIR/.nv-meta/dataset.yaml`` declaring a ``CrudeWebdataset`` with our subflavors, in the
form ``energon prepare --sample-type CrudeWebdataset`` writes.

Splits (`prep.energon.split`): by default the split `prep pack --split-ratio` recorded
(every pack in train without one), given to Energon as one shard-list pattern per split;
``--split-ratio`` moves the split to the nearest shard boundaries and is refused when those
are far from the ratio; ``--split-pattern`` is passed to Energon as is.

Invariants: only the shards ``shards.json`` lists are indexed (never stray temp files), each
of the size it records (and, with ``--verify``, the sha256);
``verify_dataset`` loads every split with Energon's ``get_train_dataset`` /
``get_val_dataset`` and requires every pack back exactly once, in the split the index
names, cooked without error.

Example: 3 shards packed with ``--split-ratio 0.8,0.2,0`` and recorded as train = shards 0-1,
val = shard 2 -> split.yaml ``train: [shards/shard-{000000..000001}.tar]``, ``val:
[shards/shard-000002.tar]``, ``test: []``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import yaml
from tqdm import tqdm

from packvlm.atomic import write_bytes_atomic
from packvlm.errors import InternalError
from prep.energon.split import ShardSplit, energon_patterns, nearest_split, recorded_split, refusal
from schemas.energon import (
    DATASET_YAML,
    META_DIR,
    EnergonIndexError,
    IndexResult,
    dataset_definition,
    read_index,
    read_packed_dir,
)
from schemas.manifest import SHARDS_MANIFEST_FILE
from schemas.packed import PackedOutput, check_shard_files
from schemas.splits import SplitRatio, SplitRatioError
from schemas.splits import parse_split_ratio as parse_ratio

log = logging.getLogger(__name__)
T = TypeVar("T")


class EnergonVerifyError(InternalError):
    """Loading the dataset with Energon did not give every pack exactly once."""


def parse_split_ratio(text: str) -> SplitRatio:
    """``"0.9,0.1,0"`` -> (0.9, 0.1, 0.0) (train, val, test)."""
    try:
        return parse_ratio(text)
    except SplitRatioError as exc:
        raise EnergonIndexError(str(exc)) from exc


def parse_split_patterns(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """``("train:shards/shard-0000[0-8].*", ...)`` -> [(split, regex), ...]."""
    out = []
    for item in items:
        split, sep, pattern = item.partition(":")
        if not sep or not split or not pattern:
            raise EnergonIndexError(f"--split-pattern {item!r}: use SPLIT:REGEX, e.g. 'val:shards/shard-000000.tar'")
        out.append((split, pattern))
    return out


def choose_split(packed: PackedOutput, split_ratio: SplitRatio | None) -> ShardSplit:
    """The recorded split, or the nearest shard-boundary split to ``split_ratio``.

    Raises:
        EnergonIndexError: The shards cannot honour ``split_ratio`` (`prep.energon.split.refusal`).
    """
    if split_ratio is None:
        return recorded_split(packed.manifest)
    split = nearest_split([s.packs for s in packed.shards.shards], split_ratio)
    reason = refusal(split, split_ratio)
    if reason is not None:
        raise EnergonIndexError(reason)
    return split


def index_dataset(
    root: str | Path,
    *,
    split_ratio: SplitRatio | None = None,
    split_patterns: list[tuple[str, str]] | None = None,
    workers: int = 2,
    verify_hashes: bool = False,
) -> IndexResult:
    """Index the shards with `BaseWebdatasetFactory.prepare_dataset` and write dataset.yaml.

    The split is ``split_patterns`` when given, else `choose_split` (checked before Energon
    writes anything). Each shard's size is checked against ``shards.json`` first, and its
    sha256 too with ``verify_hashes``, so a damaged shard is named here rather than failing
    inside Energon's indexer or, later, inside training.

    Raises:
        ShardIntegrityError: A shard differs from ``shards.json`` (exit 1; the fix is `prep shards`).
    """
    from megatron.energon.flavors import BaseWebdatasetFactory

    root = Path(root).resolve()
    packed = read_packed_dir(root)
    hashed = check_shard_files(packed, hashes=verify_hashes)
    if verify_hashes and not hashed:
        log.warning(
            "%s records no sha256 (written by an older packvlm): sizes checked only; run `prep shards %s` to "
            "record them",
            SHARDS_MANIFEST_FILE,
            root,
        )
    shards = [s.name for s in packed.shards.shards]
    split: ShardSplit | None = None
    if split_patterns:
        patterns = split_patterns
    else:
        split = choose_split(packed, split_ratio)
        patterns = energon_patterns(split.parts(shards))
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):  # Energon prints progress; keep our stdout ours
        BaseWebdatasetFactory.prepare_dataset(
            root,
            shards,
            split_parts_patterns=patterns,
            workers=max(1, min(workers, len(shards))),
            progress_fn=_progress,
        )
    log.debug("energon prepare: %s", chatter.getvalue().strip())
    definition = yaml.dump(dataset_definition(), sort_keys=False)
    write_bytes_atomic(root / META_DIR / DATASET_YAML, definition.encode("utf-8"))
    result = read_index(root)
    if split is None:
        return result
    if result.splits != split.parts(shards):
        raise EnergonVerifyError(f"Energon wrote split parts {result.splits}, expected {split.parts(shards)}")
    return IndexResult(shard_counts=result.shard_counts, splits=result.splits, wanted=split.wanted)


def _progress(items: Iterator[T], total: int) -> Iterator[T]:
    """Energon's per-shard indexing progress, on stderr and only on a terminal (its stdout is captured)."""
    return iter(tqdm(items, total=total, desc="index", unit="shard", disable=not sys.stderr.isatty()))


def _load_keys(root: Path, split: str, num_workers: int) -> list[str]:
    """Keys of one split as Energon loads it once: train via `get_train_dataset` (repeat=False,
    no shuffle), other splits via `get_val_dataset`."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

    from packvlm.energon import PackedTaskEncoder, quiet_pin_memory_without_accelerator

    quiet_pin_memory_without_accelerator()
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
    if split == "train":
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
    else:
        ds = get_val_dataset(
            root,
            split_part=split,
            worker_config=worker_config,
            batch_size=None,  # one pack per item, as for train
            task_encoder=PackedTaskEncoder(),
        )
    return [sample.__key__ for sample in get_loader(ds)]


def verify_dataset(root: str | Path, num_workers: int = 0) -> dict[str, int]:
    """Load every non-empty split with Energon and check each pack comes once, in its split.

    Returns:
        Packs loaded per non-empty split.

    Raises:
        EnergonVerifyError: A pack is missing, repeated or unknown, or a split loads another
            number of packs than its shards hold.
    """
    root = Path(root).resolve()
    expected = read_packed_dir(root).manifest.packs.packs
    index = read_index(root)
    indexed = index.packs_per_split()
    loaded: Counter[str] = Counter()
    per_split = {}
    for split, parts in index.splits.items():
        if not parts:
            continue
        keys = _load_keys(root, split, num_workers)
        if len(keys) != indexed[split]:
            raise EnergonVerifyError(
                f"Energon loaded {len(keys)} packs of split {split}, its shards hold {indexed[split]}"
            )
        loaded.update(keys)
        per_split[split] = len(keys)
    repeated = [k for k, c in loaded.items() if c > 1]
    if repeated or len(loaded) != expected:
        raise EnergonVerifyError(f"Energon loaded {len(loaded)} distinct packs of {expected}; repeated {repeated[:5]}")
    return per_split
