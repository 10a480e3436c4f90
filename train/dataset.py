"""Open a `prep pack` + `prep energon-index` directory for training, or say what to fix.

Checks, in the order a user would fix them: the path exists; it is a complete packed directory
(``manifest.json`` and ``shards.json`` of this schema version, every shard there and of the size
``shards.json`` records, read with `schemas.packed.read_packed_output`); ``prep energon-index`` ran (``.nv-meta`` with
``dataset.yaml``, ``split.yaml``, ``.info.json`` and a ``.tar.idx`` per shard); the pack
format version (``dataset.yaml`` subflavors and the first pack's json) is the one this code
reads; the processor identity `prep pack` recorded for its inputs (class and settings) equals
the processor given for training, and the model takes that processor's inputs and token ids
(`train.identity`); its model attends inside image blocks the way the family's training layout
applies (causal, or bidirectional where the layout declares it: Gemma 3, `train.block_attention`;
anything else refused); the train split holds at least one pack per data-parallel worker.

Example::

    info = open_packed_dataset("./example-out/packed", processor_class="Qwen2VLProcessor")
    info.num_packs, info.pack_size  # (11, 1024)
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from families.processor import ProcessorBundle, load_processor_once
from families.registry import find_layout
from families.requirements import check_processor_class, declared_processor_class
from packvlm.errors import UsageError
from schemas.energon import (
    DATASET_YAML,
    INDEX_SUFFIX,
    INFO_JSON,
    META_DIR,
    SPLIT_YAML,
    EnergonIndexError,
    read_index,
    read_packed_dir,
)
from schemas.layout import MANIFEST_FILE
from schemas.manifest import ManifestError, ManifestVersionError, PackManifest
from schemas.packed import (
    META_MEMBER,
    PACK_SUBFLAVORS,
    PACKED_READ_VERSIONS,
    IncompleteShardsError,
    PackedOutput,
    PackMeta,
    check_shard_files,
)
from train.context_parallel import padding_problem
from train.identity import (
    IdentityMismatch,
    ModelConfigSource,
    check_model_matches_data,
    check_processor_identity,
    load_model_config,
)
from train.media import MediaProcessor, PackEncodeError, video_package_missing
from train.preflight import first_video


class TrainConfigError(UsageError, ValueError):
    """A training input is unusable; the message says what to run or change."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedDatasetInfo:
    """What training needs to know about a packed dataset, validated."""

    path: Path
    pack_size: int
    pad_to_multiple_of: int
    num_packs: int  # in the split opened
    num_shards: int  # in the split opened
    split: str
    processor_class: str | None  # recorded by `prep pack` per input; None only without inputs
    tokenized_inputs: tuple[str, ...]


def _packed_output(root: Path) -> PackedOutput:
    if not root.exists():
        raise TrainConfigError(f"--data {root}: does not exist")
    if not (root / MANIFEST_FILE).is_file():
        raise TrainConfigError(
            f"--data {root}: no {MANIFEST_FILE}; not a `prep pack` output: run `prep pack TOKENIZED --output {root} "
            "--pack-size N` then `prep energon-index` on it"
        )
    try:
        packed = read_packed_dir(root)
    except (EnergonIndexError, IncompleteShardsError, ManifestVersionError) as exc:  # each names its fix
        raise TrainConfigError(f"--data {root}: {exc}") from exc
    except ManifestError as exc:  # another stage's manifest, or malformed
        raise TrainConfigError(f"--data {root}: {exc}; point --data at a `prep pack` output") from exc
    check_shard_files(packed, hashes=False)  # a truncated shard: a data error now, not a decode error mid-run
    return packed


def _check_index(root: Path, shards: list[str]) -> None:
    """Energon's index files exist for this directory and each of its shards."""
    meta = root / META_DIR
    fix = f"run `prep energon-index {root}`"
    if not meta.is_dir():
        raise TrainConfigError(f"--data {root}: no {META_DIR}/ (not indexed for Energon): {fix}")
    missing = [name for name in (DATASET_YAML, SPLIT_YAML, INFO_JSON) if not (meta / name).is_file()]
    missing += [f"{s}{INDEX_SUFFIX}" for s in shards if not (root / f"{s}{INDEX_SUFFIX}").is_file()]
    if missing:
        raise TrainConfigError(f"--data {root}: index files {missing[:5]} missing: {fix}")


def _check_format(root: Path, first_shard: str) -> None:
    """``dataset.yaml`` subflavors and the first pack's json are the pack format this code reads."""
    definition = yaml.safe_load((root / META_DIR / DATASET_YAML).read_text(encoding="utf-8")) or {}
    sub = definition.get("subflavors") or {}
    fix = "re-run `prep pack` and `prep energon-index` with this packvlm version"
    if any(sub.get(k) != v for k, v in PACK_SUBFLAVORS.items()):
        raise TrainConfigError(f"--data {root}: {DATASET_YAML} subflavors {sub} are not a packvlm pack dataset: {fix}")
    if sub.get("format_version") not in PACKED_READ_VERSIONS:
        raise TrainConfigError(
            f"--data {root}: pack format version {sub.get('format_version')} in {DATASET_YAML}, this code reads "
            f"{', '.join(map(str, PACKED_READ_VERSIONS))}: {fix}"
        )
    with tarfile.open(root / first_shard, "r:") as tar:
        member = next((m for m in tar if m.name.endswith(f".{META_MEMBER}")), None)
        data = tar.extractfile(member) if member else None
        raw = json.load(data) if data else None
    if raw is None:
        raise TrainConfigError(f"--data {root}: {first_shard} holds no pack json: {fix}")
    try:
        PackMeta.from_json(raw)
    except (KeyError, TypeError, ValueError) as exc:  # ValueError names a version this code does not read
        raise TrainConfigError(f"--data {root}: first pack of {first_shard}: {exc}: {fix}") from exc


def _load_processor(processor: str) -> ProcessorBundle:
    from families.processor import ProcessorLoadError

    check_processor_class(declared_processor_class(str(processor)))  # before transformers imports the family
    try:
        return load_processor_once(str(processor))
    except (ProcessorLoadError, OSError) as exc:
        raise TrainConfigError(f"--processor {processor}: cannot be loaded ({exc})") from exc


def _check_identity(
    manifest: PackManifest,
    root: Path,
    processor: str | None,
    processor_class: str | None,
    model: ModelConfigSource | None,
) -> None:
    """Processor identity (class + settings), then the model against the processor (`train.identity`)."""
    tokenized_class = tokenized_processor_class(manifest)
    bundle = _load_processor(processor) if processor is not None else None
    try:
        if bundle is not None:
            check_processor_identity(bundle, (i.processor for i in manifest.inputs), str(root))
        elif processor_class is not None and tokenized_class is not None and processor_class != tokenized_class:
            raise IdentityMismatch(
                f"--processor is a {processor_class} but {root} was tokenized with a {tokenized_class}: train with "
                "the processor the data was tokenized with, or re-run `prep tokenize` and `prep pack` with yours"
            )
        if bundle is not None and model is not None:
            layout = MediaProcessor.from_bundle(bundle, "float32").layout
            name = model if isinstance(model, str) else type(model).__name__
            check_model_matches_data(load_model_config(model), bundle, layout.mm_token_ids, str(name))
    except (IdentityMismatch, PackEncodeError) as exc:
        raise TrainConfigError(str(exc)) from exc


def _check_video_support(root: Path, processor: str, shard_packs: dict[str, int], parts: list[str]) -> None:
    """Stop before training when the split holds a video the family's video processor needs a missing package for."""
    layout = MediaProcessor.from_bundle(_load_processor(processor), "float32").layout
    package = getattr(layout, "missing_video_package", None)
    if package is None:
        return
    where = first_video(root, shard_packs=shard_packs, split_shards=parts)
    if where is not None:
        raise video_package_missing(f"--data {root} ({where})", package)


def tokenized_processor_class(manifest: PackManifest) -> str | None:
    """The processor class the pack's inputs were tokenized with, as `prep pack` recorded it."""
    classes = {item.processor.class_name for item in manifest.inputs}
    if len(classes) > 1:
        raise TrainConfigError(f"the pack inputs were tokenized with different processors {sorted(classes)}")
    return classes.pop() if classes else None


def _check_attention(manifest: PackManifest) -> None:
    """Refuse data whose image-block attention the family's training layout does not apply exactly.

    The counter records it (``image_attention``); the layout (`families/<name>/layout.py`) declares the rule
    its packed rows carry: causal by default, "bidirectional" for Gemma 3 (image blocks in the
    batch, `train.block_attention`). Any other pairing would train with the wrong mask.
    """
    for item in manifest.inputs:
        recorded = item.processor.image_attention
        layout = find_layout(item.processor.class_name)
        applied = getattr(layout, "image_attention", "causal") if layout is not None else "causal"
        if recorded != applied:
            raise TrainConfigError(
                f"{item.path} was tokenized with a {item.processor.class_name}, whose model attends "
                f"{recorded}ly inside each image block; packed training here applies {applied} image-block "
                "attention for it and would train it with the wrong mask. Train this family unpacked (one sample per "
                "row, the model's own mask) until packvlm builds its packed image-block masks"
            )


def open_packed_dataset(
    path: str | Path,
    processor: str | None = None,
    *,
    processor_class: str | None = None,
    model: ModelConfigSource | None = None,
    split: str = "train",
    min_packs: int = 1,
    cp_size: int = 1,
) -> PackedDatasetInfo:
    """Validate a packed dataset before training; raise `TrainConfigError` naming the fix
    (`TransformersVersionError` when the installed transformers predates the data's family).

    Args:
        path: The `prep pack` output directory (indexed by `prep energon-index`).
        processor: Processor directory / hub id training will use; its identity (class and
            settings) is compared with the one the data was tokenized with.
        processor_class: A class name to compare instead of ``processor``; both None skip the check.
        model: The model directory / config training will use: its family and token ids are
            checked against ``processor`` (`train.identity`).
        split: Energon split part to count.
        min_packs: Packs the split must hold at least (data-parallel ranks x loader workers).
        cp_size: Context-parallel size training runs at: every slot must be a multiple of
            ``2 * cp_size`` (`train.context_parallel`), i.e. the packs' ``--pad-to-multiple-of``.
    """
    root = Path(path).resolve()
    packed = _packed_output(root)
    manifest = packed.manifest
    shards = [s.name for s in packed.shards.shards]
    _check_index(root, shards)
    _check_format(root, shards[0])
    tokenized_class = tokenized_processor_class(manifest)
    check_processor_class(tokenized_class)  # before the processor or model loads the family's classes
    _check_identity(manifest, root, processor, processor_class, model)
    _check_attention(manifest)
    cp_problem = padding_problem(manifest.pad_to_multiple_of, cp_size)
    if cp_problem is not None:
        raise TrainConfigError(f"--data {root}: {cp_problem}")
    index = read_index(root)
    parts = index.splits.get(split) or []
    if processor is not None:
        _check_video_support(root, processor, index.shard_counts, parts)
    num_packs = sum(index.shard_counts.get(p, 0) for p in parts)
    if num_packs < max(1, min_packs):
        raise TrainConfigError(
            f"--data {root}: split {split!r} holds {num_packs} packs but {max(1, min_packs)} data-parallel workers "
            "(ranks x loader workers) each need one: use fewer ranks/workers, or re-index with more packs in "
            f"{split!r} (`prep energon-index {root} --split-ratio 1,0,0`)"
        )
    return PackedDatasetInfo(
        path=root,
        pack_size=manifest.pack_size,
        pad_to_multiple_of=manifest.pad_to_multiple_of,
        num_packs=num_packs,
        num_shards=len(parts),
        split=split,
        processor_class=tokenized_class,
        tokenized_inputs=tuple(i.path for i in manifest.inputs),
    )
