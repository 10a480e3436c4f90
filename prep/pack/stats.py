"""Pack statistics for the manifest and the end-of-run report, computed from the plan.

LB2 (Martello-Toth) sits beside the achieved pack count so a reader can see how close to
optimal the plan is without trusting the packer; efficiency = real tokens / pack capacity.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa

from packvlm.atomic import write_arrow_atomic
from prep.pack.assignment import PackAssignment
from prep.pack.bounds import lower_bound_l1
from schemas.manifest import PackManifest, PackSplit, PackStatistics, ShardsManifest
from schemas.packed import PACK_STATS_SCHEMA

FILL_BINS = 10


def _counts(values: np.ndarray) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values.tolist()).items())}


def pack_statistics(plan: PackAssignment, num_tokens: np.ndarray, media_count: np.ndarray) -> PackStatistics:
    """Counts, bounds, efficiency and histograms (fill, samples per pack, media per pack)."""
    n = plan.num_packs
    starts = plan.pack_offsets[:-1]
    items = plan.item_order
    tokens = np.add.reduceat(num_tokens[items], starts) if n else np.zeros(0, np.int64)
    media = np.add.reduceat(media_count[items], starts) if n else np.zeros(0, np.int64)
    fill = tokens / plan.pack_size
    bins = np.minimum((fill * FILL_BINS).astype(np.int64), FILL_BINS - 1)
    fill_hist = np.bincount(bins, minlength=FILL_BINS)
    packed = np.ones(num_tokens.size, bool)
    packed[plan.oversize] = False
    return PackStatistics(
        packs=n,
        lb1=lower_bound_l1(plan.slot_lengths[packed], plan.pack_size) if n else 0,
        lb2=plan.lb2,
        packs_over_lb2=n - plan.lb2,
        efficiency=round(plan.efficiency, 6),
        tokens=plan.num_tokens,
        pad_tokens=plan.slot_tokens - plan.num_tokens,
        empty_tokens=n * plan.pack_size - plan.num_tokens,
        fill_histogram={f"{k / FILL_BINS:.1f}-{(k + 1) / FILL_BINS:.1f}": int(c) for k, c in enumerate(fill_hist)},
        samples_per_pack=_counts(np.diff(plan.pack_offsets)),
        media_per_pack=_counts(media),
    )


def write_pack_table(
    path: Path, plan: PackAssignment, shard_offsets: np.ndarray, num_tokens: np.ndarray, media_count: np.ndarray
) -> None:
    """One row per pack (`PACK_STATS_SCHEMA`) via temp + rename, for `prep stats` plots."""
    starts, items = plan.pack_offsets[:-1], plan.item_order
    n = plan.num_packs

    def per_pack(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values[items], starts) if n else np.zeros(0, np.int64)

    table = pa.table(
        {
            "pack": np.arange(n, dtype=np.int64),
            "shard": np.repeat(np.arange(shard_offsets.size - 1), np.diff(shard_offsets)).astype(np.int32),
            "num_tokens": per_pack(num_tokens).astype(np.int32),
            "slot_tokens": per_pack(plan.slot_lengths).astype(np.int32),
            "num_samples": np.diff(plan.pack_offsets).astype(np.int32),
            "num_media": per_pack(media_count).astype(np.int32),
        },
        schema=PACK_STATS_SCHEMA,
    )
    write_arrow_atomic(path, table)


def format_splits(splits: tuple[PackSplit, ...]) -> str:
    """``train 9 packs in 3 shards, val 1 pack in 1 shard`` (splits empty and not asked for left out)."""
    shown = [s for s in splits if s.packs or s.ratio > 0]
    return ", ".join(
        f"{s.name} {s.packs:,} pack{'s' * (s.packs != 1)} in {s.shards:,} shard{'s' * (s.shards != 1)}" for s in shown
    )


def format_summary(manifest: PackManifest, shards: ShardsManifest | None, output_dir: str) -> str:
    """Human-readable end-of-run report of a pack run (and of its shards when written)."""
    s, p = manifest.samples, manifest.packs
    gap = f"{(p.packs / p.lb2 - 1):.3%}" if p.lb2 else "n/a"
    lines = [
        f"samples: {s.total:,} tokenized = {s.packed:,} packed + {s.oversize:,} oversize (dropped)",
        f"packs: {p.packs:,} (LB2 {p.lb2:,}, +{gap}); efficiency {p.efficiency:.2%} of "
        f"{manifest.pack_size:,}-token packs; {p.tokens:,} tokens, {p.pad_tokens:,} padding",
        f"splits: {format_splits(manifest.splits)}",
        "fill: " + "  ".join(f"{k}:{v}" for k, v in p.fill_histogram.items() if v),
    ]
    if shards is not None:
        lines.insert(2, f"shards: {len(shards.shards):,} in {output_dir}, {shards.num_bytes / 1e6:,.1f} MB")
    if manifest.oversize:
        ids = ", ".join(o.sample_id for o in manifest.oversize[:5])
        lines.append(f"oversize: {ids}{' ...' if len(manifest.oversize) > 5 else ''} (see manifest.json)")
    return "\n".join(lines)
