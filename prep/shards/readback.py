"""Reading written shards back: the conservation check of `prep shards`.

Only the ``json`` members are parsed (`iter_pack_metas` seeks over arrays and media), so
the check costs a small fraction of the write; it runs on every run, resumed or not, and
is what ``shards.json`` is computed from. Together with the pack stage's plan check
(every tokenized sample in the plan or in the oversize report) it proves every input
sample is in exactly one pack.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from packvlm.errors import InternalError
from prep.shards.tar import iter_pack_metas
from schemas.manifest import ShardRecord, file_sha256
from schemas.packed import SHARDS_DIR, pack_key, shard_name
from schemas.plan import PackPlan


class PackConservationError(InternalError):
    """The shards on disk do not hold the plan's samples exactly once each: a bug, never ignored."""


def check_shards(
    out: Path, plan: PackPlan, rows: pa.Table, written_sha256: Mapping[int, str] | None = None
) -> tuple[ShardRecord, ...]:
    """Read every shard back: each pack in its planned shard, holding exactly its planned samples.

    Args:
        out: The packed directory.
        plan: The plan header (shard offsets).
        rows: The plan rows (``pack``, ``input``, ``sample_id``), in pack order.
        written_sha256: Shard index -> sha256 its writer hashed in this run; other shards (written
            by an earlier, interrupted run) are hashed here.

    Returns:
        One record per shard: name, packs, samples, bytes, sha256.
    """
    pack_col = rows.column("pack").to_numpy()
    bounds = np.searchsorted(pack_col, np.arange(plan.num_packs + 1))
    inputs = rows.column("input").to_pylist()
    ids = rows.column("sample_id").to_pylist()
    records = []
    for s in tqdm(range(plan.num_shards), desc="read-back", unit="shard", disable=not sys.stderr.isatty()):
        path = out / SHARDS_DIR / shard_name(s)
        first, last = plan.shard_offsets[s], plan.shard_offsets[s + 1]
        try:
            metas = list(iter_pack_metas(path))
        except (OSError, ValueError) as exc:
            raise PackConservationError(f"{exc}; delete {path} and rerun `prep shards` to rewrite it") from exc
        keys = [key for key, _ in metas]
        if keys != [pack_key(p) for p in range(first, last)]:
            raise PackConservationError(
                f"{path} holds packs {keys[:3]}... but the plan puts packs {first}..{last - 1} there; delete it and "
                "rerun `prep shards`"
            )
        samples = 0
        for p, (key, meta) in zip(range(first, last), metas):
            got = [(int(x["input"]), str(x["sample_id"])) for x in meta["samples"]]
            want = list(zip(inputs[bounds[p] : bounds[p + 1]], ids[bounds[p] : bounds[p + 1]]))
            if got != want:
                raise PackConservationError(f"{path} {key} holds samples {got[:3]}..., the plan says {want[:3]}...")
            samples += len(got)
        sha256 = (written_sha256 or {}).get(s) or file_sha256(path)
        name = f"{SHARDS_DIR}/{path.name}"
        records.append(
            ShardRecord(name=name, packs=len(keys), samples=samples, bytes=path.stat().st_size, sha256=sha256)
        )
    if sum(r.samples for r in records) != rows.num_rows:
        raise PackConservationError(f"shards hold {sum(r.samples for r in records)} samples, the plan {rows.num_rows}")
    return tuple(records)
