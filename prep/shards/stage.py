"""`prep shards` stage: a packed directory's ``plan.arrow`` -> webdataset shards + ``shards.json``.

Inputs: ``PACKED/plan.arrow`` (:mod:`schemas.plan`) and the tokenized parts it names, pinned
by their manifests' sha256 (a changed input is refused, never silently mixed), and the plan
header's ``pack_size`` checked equal to ``PACKED/manifest.json``'s. Outputs:
``PACKED/shards/shard-NNNNNN.tar`` (:mod:`schemas.packed`) and ``PACKED/shards.json``
(`ShardsManifest`). The plan is the contract with `prep pack`; the manifest is read only for
that check.

Invariants: one task per shard, written via temp + rename, so a rerun writes only the
missing shards and ends byte-identical to an uninterrupted run; every shard is read back
against the plan before ``shards.json`` is written, with its size and sha256 (hashed as it is
written). A rerun over a finished directory rewrites every shard that no longer matches them
(truncated, overwritten, a flipped byte): that is the repair `train` and `prep energon-index`
name when they find one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from packvlm.atomic import clear_stale, write_json_atomic
from packvlm.faults import crash_point
from prep.run import ExecutorConfig, run_tasks
from prep.shards.core import ShardTask
from prep.shards.readback import check_shards
from prep.shards.worker import ShardWorker
from schemas.layout import MANIFEST_FILE, SAMPLES_DIR
from schemas.manifest import (
    SHARDS_MANIFEST_FILE,
    ManifestError,
    PackManifest,
    ShardsManifest,
    file_sha256,
    read_manifest,
)
from schemas.packed import SHARDS_DIR, shard_difference, shard_name
from schemas.plan import PLAN_FILE, PackPlan, PlanError, read_plan
from schemas.tokenized import TokenizedPartError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardsConfig:
    """Every option of `prep shards`; none changes the bytes written."""

    packed_dir: str
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)


def _check_inputs(plan: PackPlan) -> None:
    """The tokenized inputs are still the ones planned from (same manifest bytes)."""
    for item in plan.inputs:
        manifest = Path(item.path) / MANIFEST_FILE
        if not manifest.is_file() or file_sha256(manifest) != item.manifest_sha256:
            raise TokenizedPartError(
                f"{item.path} changed or vanished since the plan was made (its {MANIFEST_FILE} differs); rerun "
                "`prep pack` into a new directory"
            )


def _check_pack_size(plan: PackPlan, out: Path) -> None:
    """The plan header's ``pack_size`` (what the shards are cut to) is the pack manifest's (what
    `train` and `prep energon-index` read). A directory without ``manifest.json`` (`prep pack`
    stopped before writing it) has no second copy to disagree with.

    Raises:
        PlanError: The two differ: one file was edited or copied in from another run.
    """
    if not (out / MANIFEST_FILE).is_file():
        return
    manifest = read_manifest(out / MANIFEST_FILE, PackManifest)
    if manifest.pack_size != plan.pack_size:
        raise PlanError(
            f"{out / PLAN_FILE} has pack_size {plan.pack_size} but {out / MANIFEST_FILE} has {manifest.pack_size}: "
            "one was edited or copied from another run; rerun `prep pack` into a new directory"
        )


def _tasks(plan: PackPlan, rows: pa.Table) -> list[ShardTask]:
    """One task per shard: (pack, ((global part id, row), ...)) in plan order."""
    first_part = [0]
    for item in plan.inputs:
        first_part.append(first_part[-1] + len(item.parts))
    packs = rows.column("pack").to_pylist()
    parts = [first_part[i] + p for i, p in zip(rows.column("input").to_pylist(), rows.column("part").to_pylist())]
    locations = list(zip(parts, rows.column("row").to_pylist()))
    per_pack: list[list[tuple[int, int]]] = [[] for _ in range(plan.num_packs)]
    for pack, location in zip(packs, locations):
        per_pack[pack].append(location)
    return [
        ShardTask(
            shard=s,
            packs=tuple((p, tuple(per_pack[p])) for p in range(plan.shard_offsets[s], plan.shard_offsets[s + 1])),
        )
        for s in range(plan.num_shards)
    ]


def _worker_kwargs(plan: PackPlan, out: Path) -> dict[str, object]:
    parts = [
        [str(Path(item.path) / SAMPLES_DIR / part), k] for k, item in enumerate(plan.inputs) for part in item.parts
    ]
    return {
        "parts_json": json.dumps(parts),
        "output_dir": str(out),
        "pack_size": plan.pack_size,
        "pad_to_multiple_of": plan.pad_to_multiple_of,
    }


def _remove_damaged(out: Path, plan_sha256: str) -> None:
    """Delete the shards that differ (size or sha256) from a ``shards.json`` of this plan, so this run
    rewrites them: re-running `prep shards` is the repair `check_shard_files` names. Without such a
    manifest (a first or interrupted run) shards on disk are whole: written via temp + rename."""
    try:
        recorded = read_manifest(out / SHARDS_MANIFEST_FILE, ShardsManifest)
    except ManifestError:
        return
    if recorded.plan_sha256 != plan_sha256:
        return
    for record in recorded.shards:
        problem = shard_difference(out, record, hashes=True)
        if problem is not None and (out / record.name).is_file():
            log.warning("shards: %s %s: rewriting it", record.name, problem)
            (out / record.name).unlink()


def run_shards(config: ShardsConfig) -> ShardsManifest:
    """Write the shards a plan names that are missing, read all back, write ``shards.json``.

    Raises:
        PlanError: No readable ``plan.arrow``, or its ``pack_size`` differs from ``manifest.json``'s.
        TokenizedPartError, MediaVanishedError: An input changed or vanished since planning.
        PackConservationError: A shard on disk does not match the plan.
    """
    out = Path(config.packed_dir)
    plan_path = out / PLAN_FILE
    plan, rows = read_plan(plan_path)
    _check_pack_size(plan, out)
    _check_inputs(plan)
    (out / SHARDS_DIR).mkdir(exist_ok=True)
    clear_stale(out / SHARDS_DIR)
    plan_sha256 = file_sha256(plan_path)
    _remove_damaged(out, plan_sha256)
    tasks = _tasks(plan, rows)
    pending = [t.to_json() for t in tasks if not (out / SHARDS_DIR / shard_name(t.shard)).exists()]
    log.info("shards: %d packs in %d shards, %d to write", plan.num_packs, len(tasks), len(pending))
    done = run_tasks(ShardWorker, _worker_kwargs(plan, out), pending, config.executor, desc="shards")
    written = {int(row["shard"]): str(row["sha256"]) for row in done}
    manifest = ShardsManifest.create(plan_sha256=plan_sha256, shards=check_shards(out, plan, rows, written))
    crash_point("shards.before_manifest")
    write_json_atomic(out / SHARDS_MANIFEST_FILE, manifest.to_json())
    return manifest
