"""`prep stats`: flags -> StatsConfig -> run_stats."""

from __future__ import annotations

import click

from prep.stats.stage import DEFAULT_BINS


@click.command("stats")
@click.argument("input_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--output",
    "output_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Report directory (default: INPUT_DIR/stats).",
)
@click.option(
    "--bins", type=click.IntRange(min=1), default=DEFAULT_BINS, show_default=True, help="Most bins per histogram."
)
@click.option(
    "--pack-size",
    type=click.IntRange(min=1),
    default=None,
    help="Mark this pack size on a tokenized dir's sample-length plot (a packed dir marks its own).",
)
def stats_command(input_dir: str, output_dir: str | None, bins: int, pack_size: int | None) -> None:
    """Token, error and pack statistics of a tokenized or packed directory, as JSON + HTML."""
    from prep.stats.stage import StatsConfig, format_summary, run_stats

    config = StatsConfig(input_dir=input_dir, output_dir=output_dir, bins=bins, pack_size=pack_size)
    stats = run_stats(config)  # StatsInputError exits 2, StatsDependencyError 3 (`packvlm.cli`)
    click.echo(format_summary(stats, config.output_path()))
