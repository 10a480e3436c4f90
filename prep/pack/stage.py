"""`prep pack` stage: tokenized directories -> a frozen plan -> webdataset shards + manifest.

Inputs: one or more `prep tokenize` outputs (:mod:`schemas.tokenized`); only their length
columns are read to plan. Outputs, in ``OUT`` (:mod:`schemas.packed`): ``shards/*.tar``
(one webdataset sample per pack), ``manifest.json``, ``pack_stats.arrow`` and ``_run.json``.

Invariants: every tokenized sample is in exactly one pack or in the oversize report
(checked by reading the shards back); no pack's slots exceed ``pack_size``; shards are
written via temp + rename, so a rerun after a kill writes only the missing shards and ends
byte-identical to an uninterrupted run; ``OUT`` never mixes runs with other options.

Worked example, pack_size=1024, shard_size=2packs, lengths of samples a..e::

    a:900  b:600  c:400  d:100  e:2000
    plan (BFD):  [a, d] [b, c], order shuffled by seed    oversize = [e]
    shards:      shard-000000.tar = pack-00000000 (b, c), pack-00000001 (a, d)  (say)
    report:      packs 2, LB2 2, efficiency 2000/2048 = 97.7 %, oversize e (2000 tokens)
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prep.outputs import claim_output_dir
from prep.pack.core import PackPlan, plan_packs, verify_plan
from prep.pack.inputs import SampleColumns, TokenizedInput, check_same_processor, load_columns, load_input
from prep.pack.stats import pack_statistics, write_pack_table
from prep.shards.layout import cut_shards, estimate_pack_bytes, parse_shard_size
from prep.shards.read import sample_media_bytes
from prep.shards.readback import PackConservationError as PackConservationError  # re-export
from prep.shards.readback import check_shards
from prep.shards.worker import ShardTask, ShardWorker, unwrap_worker_error
from prep.sources.media import LmdbPool
from schemas.layout import MANIFEST_FILE
from schemas.manifest import build_manifest, write_json_atomic
from schemas.packed import PACK_STATS_FILE, SHARDS_DIR, shard_name

log = logging.getLogger(__name__)
STAGE = "pack"
OVERSIZE_POLICIES = ("drop", "error")


class OversizeError(RuntimeError):
    """``--oversize error`` and some samples exceed the pack size."""


class PackOutputConflict(RuntimeError):
    """The output directory holds other files or a run with other options."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    """Every option of `prep pack`. Fields above ``executor`` shape the output."""

    inputs: tuple[str, ...]
    output_dir: str
    pack_size: int
    max_samples_per_pack: int | None = None
    seed: int = 0
    pad_to_multiple_of: int = 1
    oversize: str = "drop"
    balance_media: bool = False
    media_group_size: int = 8
    shard_size: str = "512MB"
    executor: str = "ray"
    ray_address: str | None = None
    num_workers: int | None = None

    def output_fields(self) -> dict[str, Any]:
        """The options the output depends on (manifest and resume check)."""
        out = asdict(self)
        for key in ("output_dir", "executor", "ray_address", "num_workers"):
            out.pop(key)
        out["inputs"] = [str(Path(p).resolve()) for p in self.inputs]
        out["shard_size"] = str(parse_shard_size(self.shard_size))
        return out


def _plan(config: PackConfig, cols: SampleColumns) -> PackPlan:
    plan = plan_packs(
        cols.num_tokens,
        pack_size=config.pack_size,
        max_samples_per_pack=config.max_samples_per_pack,
        pad_to_multiple_of=config.pad_to_multiple_of,
        seed=config.seed,
        media_tokens=cols.num_media_tokens if config.balance_media else None,
        balance_media=config.balance_media,
        media_group_size=config.media_group_size,
    )
    verify_plan(plan, cols.num_tokens, config.pack_size)
    return plan


def _oversize_report(plan: PackPlan, cols: SampleColumns) -> list[dict[str, Any]]:
    starts = np.cumsum([0] + [len(ids) for ids in cols.sample_ids])
    report = []
    for i in plan.oversize.tolist():
        k = int(cols.input_index[i])
        local = i - int(starts[k])
        report.append(
            {"input": k, "sample_id": cols.sample_ids[k][local].as_py(), "num_tokens": int(cols.num_tokens[i])}
        )
    return report


def _shard_offsets(config: PackConfig, plan: PackPlan, cols: SampleColumns, inputs: list[TokenizedInput]) -> np.ndarray:
    size = parse_shard_size(config.shard_size)
    if size.max_packs is not None:
        return cut_shards(np.zeros(plan.num_packs, np.int64), size)
    from schemas.tokenized import read_column

    pool = LmdbPool()
    try:
        media_bytes = np.concatenate(
            [
                sample_media_bytes(read_column(item.root, "media"), cols.sample_ids[k], pool)
                for k, item in enumerate(inputs)
            ]
            or [np.zeros(0, np.int64)]
        )
    finally:
        pool.close()
    pack_bytes = estimate_pack_bytes(plan.pack_offsets, plan.item_order, cols.num_tokens, media_bytes, cols.media_count)
    return cut_shards(pack_bytes, size)


def _tasks(plan: PackPlan, cols: SampleColumns, offsets: np.ndarray) -> list[ShardTask]:
    tasks = []
    for s in range(offsets.size - 1):
        packs = []
        for p in range(int(offsets[s]), int(offsets[s + 1])):
            items = plan.pack(p)
            packs.append((p, tuple(zip(cols.part_id[items].tolist(), cols.row[items].tolist()))))
        tasks.append(ShardTask(shard=s, packs=tuple(packs)))
    return tasks


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PackJob:
    """A frozen plan cut into shard tasks, ready for an executor (see `plan_pack`)."""

    config: PackConfig
    inputs: list[TokenizedInput]
    cols: SampleColumns
    plan: PackPlan
    oversize: list[dict[str, Any]]
    shard_offsets: np.ndarray
    tasks: list[ShardTask]

    @property
    def worker_kwargs(self) -> dict[str, Any]:
        """JSON-safe constructor kwargs of `ShardWorker` (paths and numbers only)."""
        parts = [[part, k] for k, item in enumerate(self.inputs) for part in item.parts]
        return {
            "parts_json": json.dumps(parts),
            "output_dir": str(Path(self.config.output_dir)),
            "pack_size": self.config.pack_size,
            "pad_to_multiple_of": self.config.pad_to_multiple_of,
        }

    @property
    def run_inputs(self) -> list[dict[str, Any]]:
        return [
            {"path": i.root, "manifest_sha256": i.manifest_sha256, "processor": i.processor, "samples": i.num_samples}
            for i in self.inputs
        ]


def plan_pack(config: PackConfig) -> PackJob:
    """Check inputs, plan from the length columns, apply the oversize policy, cut shards.

    Raises:
        OversizeError: ``oversize="error"`` and a sample's slot exceeds the pack size.
        TokenizedPartError, MediaVanishedError: An input is missing, truncated or gone.
    """
    if config.oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {config.oversize!r}")
    inputs = [load_input(root) for root in config.inputs]
    check_same_processor(inputs)
    cols = load_columns(inputs)
    plan = _plan(config, cols)
    oversize = _oversize_report(plan, cols)
    if oversize and config.oversize == "error":
        ids = ", ".join(f"{o['sample_id']} ({o['num_tokens']} tokens)" for o in oversize[:20])
        raise OversizeError(
            f"{len(oversize)} samples exceed --pack-size {config.pack_size}: {ids}; raise --pack-size or use "
            "--oversize drop"
        )
    offsets = _shard_offsets(config, plan, cols, inputs)
    tasks = _tasks(plan, cols, offsets)
    return PackJob(
        config=config, inputs=inputs, cols=cols, plan=plan, oversize=oversize, shard_offsets=offsets, tasks=tasks
    )


def run_pack(config: PackConfig) -> dict[str, Any]:
    """Plan, write missing shards, check conservation, write the manifest; returns it.

    Raises:
        PackOutputConflict: ``output_dir`` holds other files or another run.
        OversizeError, TokenizedPartError, MediaVanishedError: see `plan_pack`.
    """
    fingerprint = config.output_fields()
    job = plan_pack(config)
    out = Path(config.output_dir)
    claim_output_dir(
        out, {"config": fingerprint, "inputs": job.run_inputs}, (SHARDS_DIR,), "prep pack", PackOutputConflict
    )
    pending = [t.to_json() for t in job.tasks if not (out / SHARDS_DIR / shard_name(t.shard)).exists()]
    log.info(
        "pack: %d packs in %d shards, %d to write (%s executor)",
        job.plan.num_packs,
        len(job.tasks),
        len(pending),
        config.executor,
    )
    if pending and config.executor == "local":
        from prep.run import run_local

        run_local(ShardWorker, job.worker_kwargs, pending, desc="shards")
    elif pending:
        from prep.run import run_ray

        try:
            run_ray(ShardWorker, job.worker_kwargs, pending, address=config.ray_address, num_workers=config.num_workers)
        except Exception as exc:  # Ray wraps worker errors: surface ours with their own message
            ours = unwrap_worker_error(exc)
            if ours is None:
                raise
            raise ours from exc
    shards = check_shards(out, job.tasks, job.cols.sample_ids, job.oversize)
    manifest = build_manifest(
        STAGE,
        fingerprint,
        inputs=job.run_inputs,
        samples={
            "total": int(job.cols.num_tokens.size),
            "packed": int(job.plan.item_order.size),
            "oversize": len(job.oversize),
        },
        packs=pack_statistics(job.plan, job.cols.num_tokens, job.cols.media_count),
        oversize=job.oversize,
        shards=shards,
    )
    write_pack_table(out / PACK_STATS_FILE, job.plan, job.shard_offsets, job.cols.num_tokens, job.cols.media_count)
    write_json_atomic(out / MANIFEST_FILE, manifest)
    return manifest
