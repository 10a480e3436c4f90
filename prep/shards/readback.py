"""Reading written shards back: the conservation check of `prep pack`.

Only the ``json`` members are parsed (`iter_pack_metas` seeks over arrays and media), so
the check costs a small fraction of the write; it runs on every run, resumed or not, and
is what the manifest's shard rows are computed from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from prep.shards.tar import iter_pack_metas
from prep.shards.worker import ShardTask
from schemas.packed import SHARDS_DIR, pack_key, shard_name


class PackConservationError(RuntimeError):
    """The shards on disk do not hold every packed sample exactly once: a bug, never ignored."""


def check_shards(
    out: Path, tasks: list[ShardTask], sample_ids: list[pa.ChunkedArray], oversize: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Read every shard back: each planned pack in its shard, each sample once overall.

    Args:
        out: The pack output directory.
        tasks: The shard tasks of the plan.
        sample_ids: Per input, the tokenized ``sample_id`` column.
        oversize: The oversize report (``input``, ``sample_id``).

    Returns:
        One manifest row per shard: name, packs, samples, bytes.
    """
    seen: set[tuple[int, str]] = set()
    shards = []
    for task in tasks:
        path = out / SHARDS_DIR / shard_name(task.shard)
        keys, samples = [], 0
        try:
            metas = list(iter_pack_metas(path))
        except ValueError as exc:
            raise PackConservationError(f"{exc}; delete {path} and rerun to rewrite it") from exc
        for key, meta in metas:
            keys.append(key)
            for s in meta["samples"]:
                ident = (int(s["input"]), str(s["sample_id"]))
                if ident in seen:
                    raise PackConservationError(
                        f"sample {ident[1]} (input {ident[0]}) appears twice; second time in {path} {key}"
                    )
                seen.add(ident)
                samples += 1
        if keys != [pack_key(p) for p, _ in task.packs]:
            raise PackConservationError(
                f"{path} holds packs {keys[:3]}... but the plan puts {len(task.packs)} other packs there; "
                "delete it and rerun"
            )
        shards.append(
            {"name": f"{SHARDS_DIR}/{path.name}", "packs": len(keys), "samples": samples, "bytes": path.stat().st_size}
        )
    for o in oversize:
        seen.add((o["input"], o["sample_id"]))
    expected = {(k, sid) for k, ids in enumerate(sample_ids) for sid in ids.to_pylist()}
    total = sum(len(ids) for ids in sample_ids)
    if seen != expected or len(expected) != total:
        lost = sorted(expected - seen)[:5]
        extra = sorted(seen - expected)[:5]
        raise PackConservationError(
            f"{total} tokenized samples, {len(seen)} in packs + oversize; lost {lost}, unknown {extra}"
        )
    return shards
