"""`prep pack` stage: tokenized directories -> a frozen plan (``plan.arrow``) + manifest.

Inputs: one or more `prep tokenize` outputs (:mod:`schemas.tokenized`); only their length
columns are read. Outputs, in ``OUT`` (:mod:`schemas.packed`): ``plan.arrow``
(:mod:`schemas.plan`), ``pack_stats.arrow``, ``manifest.json`` (`PackManifest`) and
``_run.json``. The shards are written from the plan by the `prep shards` stage
(`prep pack` runs it next by default).

Invariants: every tokenized sample is in exactly one pack or in the oversize report
(`verify_plan`); no pack's slots exceed ``pack_size``; packs go to train, val, test in plan
order by ``split_ratio`` (`schemas.splits.split_pack_counts`) and no shard spans two splits;
files are written via temp + rename, plan first, manifest last, so a rerun after a kill
resumes; ``OUT`` never mixes runs with other options.

Worked example, pack_size=1024, shard_size=2packs, lengths of samples a..e::

    a:900  b:600  c:400  d:100  e:2000
    plan (BFD):  [a, d] [b, c], order shuffled by seed    oversize = [e]
    plan.arrow:  pack 0 = (b, c), pack 1 = (a, d), both in shard 0  (say)
    report:      packs 2, LB2 2, efficiency 2000/2048 = 97.7 %, oversize e (2000 tokens)

With ``split_ratio=(0.5, 0.5, 0)`` the same plan puts pack 0 in train (shard 0) and pack 1 in
val (shard 1): shards are cut again at the split boundary.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from packvlm.atomic import write_arrow_atomic, write_json_atomic
from packvlm.errors import DataBudgetError, UsageError
from packvlm.faults import crash_point
from packvlm.output_dir import claim_output_dir
from prep.pack.assignment import PackAssignment
from prep.pack.core import plan_packs
from prep.pack.inputs import SampleColumns, TokenizedInput, check_same_processor, load_columns, load_input
from prep.pack.plan_rows import build_plan
from prep.pack.shard_cut import ShardSize, cut_split_shards, estimate_pack_bytes, parse_shard_size
from prep.pack.stats import pack_statistics, write_pack_table
from prep.pack.verify import verify_plan
from schemas.codec import to_json
from schemas.layout import MANIFEST_FILE
from schemas.manifest import (
    OversizeSample,
    PackManifest,
    PackSampleCounts,
    PackSplit,
    PlanFile,
    file_sha256,
    read_manifest,
)
from schemas.packed import PACK_STATS_FILE, SHARDS_DIR
from schemas.plan import PLAN_FILE
from schemas.splits import SPLIT_NAMES, SplitRatio, split_offsets, split_pack_counts
from schemas.stages import Stage

log = logging.getLogger(__name__)
OversizePolicy = Literal["drop", "error"]
OVERSIZE_POLICIES: tuple[OversizePolicy, ...] = ("drop", "error")


class OversizeError(DataBudgetError):
    """``--oversize error`` and some samples exceed the pack size."""


class NoPacksError(DataBudgetError):
    """The plan would hold no pack (every sample oversize, or no sample at all): nothing to train on."""


class PackOptionsError(UsageError, ValueError):
    """Options that contradict each other or would drop every sample."""


class PackOutputConflict(UsageError):
    """The output directory holds other files or a run with other options."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    """Every option of `prep pack` that shapes its output; the defaults live here only."""

    inputs: tuple[str, ...]
    output_dir: str
    pack_size: int
    max_samples_per_pack: int | None = None
    seed: int = 0
    pad_to_multiple_of: int = 1
    oversize: OversizePolicy = "drop"
    max_oversize_rate: float = 0.01  # "drop" fails past this fraction of samples: data is never lost quietly
    balance_media: bool = False
    media_group_size: int = 8
    shard_size: ShardSize = parse_shard_size("512MB")
    split_ratio: SplitRatio | None = None  # train, val, test; None = every pack in train

    def output_fields(self) -> dict[str, Any]:
        """The options the output depends on (manifest and resume check)."""
        out = asdict(self)
        out.pop("output_dir")
        out.pop("max_oversize_rate")  # a budget, not an output option: raising it after a refusal just runs
        out["inputs"] = [str(Path(p).resolve()) for p in self.inputs]
        out["shard_size"] = str(self.shard_size)
        return out


def _assign(config: PackConfig, cols: SampleColumns) -> PackAssignment:
    assignment = plan_packs(
        cols.num_tokens,
        pack_size=config.pack_size,
        max_samples_per_pack=config.max_samples_per_pack,
        pad_to_multiple_of=config.pad_to_multiple_of,
        seed=config.seed,
        media_tokens=cols.num_media_tokens if config.balance_media else None,
        balance_media=config.balance_media,
        media_group_size=config.media_group_size,
    )
    verify_plan(assignment, cols.num_tokens, config.pack_size)
    return assignment


def _oversize_report(assignment: PackAssignment, cols: SampleColumns) -> tuple[OversizeSample, ...]:
    starts = np.cumsum([0] + [len(ids) for ids in cols.sample_ids])
    report = []
    for i in assignment.oversize.tolist():
        k = int(cols.input_index[i])
        sample_id = cols.sample_ids[k][i - int(starts[k])].as_py()
        report.append(OversizeSample(input=k, sample_id=sample_id, num_tokens=int(cols.num_tokens[i])))
    return tuple(report)


def _shard_offsets(
    size: ShardSize, assignment: PackAssignment, cols: SampleColumns, splits: tuple[int, ...]
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Cut each split's run of the pack order into shards, from sizes known before writing
    (tokenize recorded media bytes); returns the shard offsets and each shard's split."""
    if size.max_packs is not None:
        pack_bytes = np.zeros(assignment.num_packs, np.int64)
    else:
        pack_bytes = estimate_pack_bytes(
            assignment.pack_offsets, assignment.item_order, cols.num_tokens, cols.media_bytes, cols.media_count
        )
    return cut_split_shards(pack_bytes, size, splits, SPLIT_NAMES)


def _split_records(
    ratio: SplitRatio, splits: tuple[int, ...], shard_offsets: np.ndarray, pack_offsets: np.ndarray
) -> tuple[PackSplit, ...]:
    """The manifest's splits: packs, samples and shards of train, val, test."""
    first_shards = np.searchsorted(shard_offsets, np.asarray(splits, np.int64)).tolist()
    return tuple(
        PackSplit(
            name=name,
            ratio=float(ratio[i]),
            packs=splits[i + 1] - splits[i],
            samples=int(pack_offsets[splits[i + 1]] - pack_offsets[splits[i]]),
            first_pack=splits[i],
            first_shard=int(first_shards[i]),
            shards=int(first_shards[i + 1] - first_shards[i]),
        )
        for i, name in enumerate(SPLIT_NAMES)
    )


def check_options(config: PackConfig) -> None:
    """Options that would drop everything or contradict each other are usage errors.

    Raises:
        PackOptionsError: Names the options and what to change.
    """
    if config.pad_to_multiple_of > config.pack_size:
        raise PackOptionsError(
            f"--pad-to-multiple-of {config.pad_to_multiple_of} > --pack-size {config.pack_size}: every sample would "
            "be oversize; use a multiple that divides the pack size"
        )
    if config.pack_size % config.pad_to_multiple_of:
        raise PackOptionsError(
            f"--pack-size {config.pack_size} is not a multiple of --pad-to-multiple-of {config.pad_to_multiple_of}: "
            "the last slot rounding would waste the remainder of every pack"
        )
    if not 0.0 <= config.max_oversize_rate <= 1.0:
        raise PackOptionsError(f"--max-oversize-rate {config.max_oversize_rate} must lie in [0, 1]")


def _check_oversize(config: PackConfig, oversize: tuple[OversizeSample, ...], num_samples: int) -> None:
    """``error``: any oversize sample fails; ``drop``: fails past ``max_oversize_rate`` of the samples."""
    if not oversize:
        return
    rate = len(oversize) / num_samples
    if config.oversize == "drop" and rate <= config.max_oversize_rate:
        return
    ids = ", ".join(f"{o.sample_id} ({o.num_tokens} tokens)" for o in oversize[:10])
    more = f" and {len(oversize) - 10} more" if len(oversize) > 10 else ""
    budget = "" if config.oversize == "error" else f" > --max-oversize-rate {config.max_oversize_rate:.1%}"
    raise OversizeError(
        f"{len(oversize)} of {num_samples} samples ({rate:.1%}){budget} exceed --pack-size {config.pack_size}: "
        f"{ids}{more}; raise --pack-size, cut them at tokenize time (--max-length), or accept dropping them "
        "(--oversize drop --max-oversize-rate R); nothing was written"
    )


def _check_some_pack(config: PackConfig, num_packs: int, num_samples: int, num_oversize: int) -> None:
    """A plan without packs is refused: `prep energon-index` and training would fail on it later."""
    if num_packs:
        return
    if not num_samples:
        why = "the inputs hold no sample (every row of `prep tokenize` was an error row: see `prep errors`)"
    else:
        why = f"all {num_oversize} samples exceed --pack-size {config.pack_size}: raise --pack-size"
    raise NoPacksError(f"no pack to write: {why}; nothing was written")


def _finished(out: Path) -> PackManifest | None:
    """The manifest of a finished plan in ``out`` (same options, checked by the claim), if intact."""
    if not (out / MANIFEST_FILE).is_file() or not (out / PLAN_FILE).is_file():
        return None
    manifest = read_manifest(out / MANIFEST_FILE, PackManifest)
    return manifest if file_sha256(out / PLAN_FILE) == manifest.plan.sha256 else None


def _load_inputs(config: PackConfig) -> list[TokenizedInput]:
    inputs = [load_input(root) for root in config.inputs]
    check_same_processor(inputs)
    return inputs


def run_pack(config: PackConfig) -> PackManifest:
    """Plan, write ``plan.arrow``, ``pack_stats.arrow`` and the manifest; returns the manifest.

    A rerun with the same options and inputs finds the manifest and returns it unchanged.

    Raises:
        PackOutputConflict: ``output_dir`` holds other files or another run.
        OversizeError: ``oversize="error"`` and a sample's slot exceeds the pack size.
        NoPacksError: No sample fits a pack (or there is none).
        ManifestError, TokenizedPartError: An input is not a complete `prep tokenize` output.
    """
    check_options(config)
    inputs = _load_inputs(config)
    out = Path(config.output_dir)
    fingerprint = {"config": config.output_fields(), "inputs": to_json([i.pack_input() for i in inputs])}
    cols = load_columns(inputs)
    assignment = _assign(config, cols)  # planning reads length columns only: cheap, even on a resume
    oversize = _oversize_report(assignment, cols)
    _check_oversize(config, oversize, int(cols.num_tokens.size))  # before anything is written
    _check_some_pack(config, assignment.num_packs, int(cols.num_tokens.size), len(oversize))
    claim_output_dir(out, fingerprint, (SHARDS_DIR,), f"prep {Stage.PACK}", PackOutputConflict)
    done = _finished(out)
    if done is not None:
        return done
    ratio = config.split_ratio or (1.0, 0.0, 0.0)
    splits = split_offsets(split_pack_counts(ratio, assignment.num_packs))
    offsets, shard_splits = _shard_offsets(config.shard_size, assignment, cols, splits)
    write_arrow_atomic(out / PLAN_FILE, build_plan(assignment, cols, inputs, offsets, shard_splits))
    write_pack_table(out / PACK_STATS_FILE, assignment, offsets, cols.num_tokens, cols.media_count)
    manifest = PackManifest.create(
        config=fingerprint["config"],
        pack_size=config.pack_size,
        pad_to_multiple_of=config.pad_to_multiple_of,
        inputs=tuple(i.pack_input() for i in inputs),
        samples=PackSampleCounts(
            total=int(cols.num_tokens.size), packed=int(assignment.item_order.size), oversize=len(oversize)
        ),
        packs=pack_statistics(assignment, cols.num_tokens, cols.media_count),
        oversize=oversize,
        plan=PlanFile(
            name=PLAN_FILE,
            sha256=file_sha256(out / PLAN_FILE),
            num_packs=assignment.num_packs,
            num_shards=int(offsets.size - 1),
        ),
        splits=_split_records(ratio, splits, offsets, assignment.pack_offsets),
    )
    crash_point("pack.before_manifest")
    write_json_atomic(out / MANIFEST_FILE, manifest.to_json())
    log.info("pack: %d packs in %d shards planned", assignment.num_packs, offsets.size - 1)
    return manifest
