"""Pure pack statistics: a packed directory's typed manifests and per-pack table -> `PackStats`.

Plan-level numbers are the `PackManifest`'s (the packer computed LB1/LB2 from the sample
lengths, which this stage does not re-read); shard totals are the `ShardsManifest`'s;
distributions come from ``pack_stats.arrow``, one row per pack. Example, pack_size 1000,
rows ``num_tokens [1000, 950, 400]``, ``num_samples [2, 5, 1]``, bins=4::

    fill: edges [0, .25, .5, .75, 1]  counts [0, 1, 0, 2]  (fill = num_tokens / pack_size)
    samples_per_pack: edges [1, 3, 5, 7] counts [2, 0, 1]  (integer bins, width 2)
"""

from __future__ import annotations

import numpy as np

from prep.errors.core import OversizeExample
from prep.stats.read import PackedTables
from prep.stats.records import Distribution, PackStats, distribution, fraction_edges, integer_distribution

OVERSIZE_EXAMPLES = 20  # oversize samples named in the report; `prep errors DIR` lists them all


def collect_packs(packed: PackedTables, bins: int) -> PackStats:
    """Plan numbers, shard totals and per-pack distributions of one packed directory."""
    manifest, shards, table = packed.manifest, packed.shards, packed.per_pack
    plan, samples = manifest.packs, manifest.samples
    tokens = table.column("num_tokens").to_numpy().astype(np.int64)
    per_pack: dict[str, Distribution] = {
        "fill": distribution(tokens / float(manifest.pack_size), fraction_edges(bins)),
        "samples_per_pack": integer_distribution(table.column("num_samples").to_numpy(), bins),
        "media_per_pack": integer_distribution(table.column("num_media").to_numpy(), bins),
    }
    return PackStats(
        pack_size=manifest.pack_size,
        num_packs=plan.packs,
        lb1=plan.lb1,
        lb2=plan.lb2,
        packs_over_lb2=plan.packs_over_lb2,
        efficiency=plan.efficiency,
        num_tokens=plan.tokens,
        pad_tokens=plan.pad_tokens,
        empty_tokens=plan.empty_tokens,
        num_samples=samples.total,
        packed_samples=samples.packed,
        oversize=samples.oversize,
        num_shards=len(shards.shards) if shards is not None else None,
        shard_bytes=shards.num_bytes if shards is not None else None,
        per_pack=per_pack,
        oversize_samples=tuple(
            OversizeExample(sample_id=o.sample_id, num_tokens=o.num_tokens, input=manifest.inputs[o.input].path)
            for o in manifest.oversize[:OVERSIZE_EXAMPLES]
        ),
        inputs=tuple(i.path for i in manifest.inputs),
    )
