"""`prep pack`: flags -> PackConfig -> run_pack."""

from __future__ import annotations

import click

from prep.pack.stage import OVERSIZE_POLICIES, PackConfig


@click.command("pack")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--output", "output_dir", required=True, type=click.Path(file_okay=False), help="Output directory (resumable)."
)
@click.option("--pack-size", required=True, type=click.IntRange(min=1), help="Tokens per pack.")
@click.option("--max-samples-per-pack", type=click.IntRange(min=1), default=None, help="Cap on samples per pack.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the pack order shuffle.")
@click.option(
    "--pad-to-multiple-of",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Round each sample's slot up to this (context parallelism).",
)
@click.option(
    "--oversize",
    type=click.Choice(OVERSIZE_POLICIES),
    default="drop",
    show_default=True,
    help="Samples longer than a pack: report and drop, or fail.",
)
@click.option(
    "--balance-media", is_flag=True, help="Order packs so each group of --media-group-size carries similar media loads."
)
@click.option(
    "--media-group-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Packs per training step across data-parallel ranks.",
)
@click.option(
    "--shard-size",
    default="512MB",
    show_default=True,
    help="Target shard size: bytes (512MB, 1GiB) or packs (1000packs).",
)
@click.option("--executor", type=click.Choice(["ray", "local"]), default="ray", show_default=True)
@click.option("--ray-address", default=None, help="Ray cluster address (default: RAY_ADDRESS or embedded Ray).")
@click.option("--num-workers", type=click.IntRange(min=1), default=None, help="Ray actors (default: CPUs - 1).")
def pack_command(**options: object) -> None:
    """Pack tokenized samples (INPUTS: `prep tokenize` outputs) into webdataset shards."""
    from prep.pack.stage import run_pack
    from prep.pack.stats import format_summary
    from prep.shards.layout import parse_shard_size

    options["inputs"] = tuple(options["inputs"])  # type: ignore[arg-type]
    parse_shard_size(str(options["shard_size"]))  # usage error before any work
    manifest = run_pack(PackConfig(**options))  # type: ignore[arg-type]
    click.echo(format_summary(manifest, str(options["output_dir"])))
