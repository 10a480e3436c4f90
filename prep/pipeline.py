"""Stages run in a row, for the CLI and the Python API: the one place they are composed.

`prep pack` is two stages: `run_pack` writes ``plan.arrow``, `run_shards` reads only that
file and the tokenized parts. Users get one call; the stages stay independent.
"""

from __future__ import annotations

from prep.pack.stage import PackConfig, run_pack
from prep.run import ExecutorConfig
from prep.shards.stage import ShardsConfig, run_shards
from schemas.manifest import PackManifest, ShardsManifest


def pack_and_shard(
    config: PackConfig, executor: ExecutorConfig | None = None, *, plan_only: bool = False
) -> tuple[PackManifest, ShardsManifest | None]:
    """Plan (resuming), then write the plan's missing shards unless ``plan_only``."""
    manifest = run_pack(config)
    if plan_only:
        return manifest, None
    return manifest, run_shards(ShardsConfig(packed_dir=config.output_dir, executor=executor or ExecutorConfig()))
