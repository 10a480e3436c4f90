"""Stages run in a row, for the CLI and the Python API: the one place they are composed.

`prep pack` is two stages: `run_pack` writes ``plan.arrow``, `run_shards` reads only that
file and the tokenized parts. Users get one call (`pack_and_shard`, the `prep pack` command
here); the stages stay independent, and their flags stay in their own cli modules.
"""

from __future__ import annotations

from typing import Any

import click

from prep.cli_options import executor_options
from prep.pack.cli import pack_config, pack_options
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


@click.command("pack")
@pack_options
@click.option("--plan-only", is_flag=True, help="Write plan.arrow and the manifest; run `prep shards` later.")
@executor_options
def pack_command(plan_only: bool, executor: ExecutorConfig, **options: Any) -> None:
    """Pack tokenized samples (INPUTS: `prep tokenize` outputs) into webdataset shards."""
    from prep.pack.stats import format_summary

    config = pack_config(options)
    manifest, shards = pack_and_shard(config, executor, plan_only=plan_only)
    click.echo(format_summary(manifest, shards, config.output_dir))
