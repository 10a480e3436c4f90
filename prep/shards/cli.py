"""`prep shards`: flags -> ShardsConfig -> run_shards (re-write shards from a plan)."""

from __future__ import annotations

import click

from prep.cli_options import executor_options
from prep.run import ExecutorConfig


@click.command("shards")
@click.argument("packed_dir", type=click.Path(exists=True, file_okay=False))
@executor_options
def shards_command(packed_dir: str, executor: ExecutorConfig) -> None:
    """Write (or finish writing) the shards of PACKED_DIR from its plan.arrow.

    `prep pack` runs this itself; use it to re-write deleted or damaged shards, or to write
    the shards of a plan made with `prep pack --plan-only` on another machine.
    """
    from prep.shards.stage import ShardsConfig, run_shards

    manifest = run_shards(ShardsConfig(packed_dir=packed_dir, executor=executor))
    click.echo(
        f"shards: {len(manifest.shards):,} in {packed_dir}, {manifest.num_packs:,} packs, "
        f"{manifest.num_bytes / 1e6:,.1f} MB"
    )
