"""`prep tokenize`: flags -> TokenizeConfig -> run_tokenize."""

from __future__ import annotations

import click

from packvlm.cli import default_of
from prep.cli_options import executor_options
from prep.run import ExecutorConfig
from prep.sources.media import DECODE_LIMIT_PIXELS
from prep.tokenize.stage import TokenizeConfig


@click.command("tokenize")
@click.option(
    "--dataset-config",
    "dataset_config",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="dataset_info.json-style config.",
)
@click.option("--processor", required=True, help="HF processor: local directory or hub id.")
@click.option(
    "--output", "output_dir", required=True, type=click.Path(file_okay=False), help="Output directory (resumable)."
)
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets of the config (repeatable).")
@click.option(
    "--max-length",
    type=click.IntRange(min=1),
    default=default_of(TokenizeConfig, "max_length"),
    help="Samples longer than this become errors.",
)
@click.option(
    "--verify-fraction",
    type=click.FloatRange(0, 1),
    default=default_of(TokenizeConfig, "verify_fraction"),
    show_default=True,
    help="Seeded fraction checked against the real processor.",
)
@click.option(
    "--seed",
    type=int,
    default=default_of(TokenizeConfig, "seed"),
    show_default=True,
    help="Seed for sample_ratio draws and verification.",
)
@click.option(
    "--rows-per-chunk",
    type=click.IntRange(min=1),
    default=default_of(TokenizeConfig, "rows_per_chunk"),
    show_default=True,
    help="Records per task/output part.",
)
@click.option(
    "--max-error-rate",
    type=click.FloatRange(0, 1),
    default=default_of(TokenizeConfig, "max_error_rate"),
    show_default=True,
    help="Exit non-zero above this error fraction.",
)
@click.option(
    "--max-image-pixels",
    type=click.IntRange(min=1, max=DECODE_LIMIT_PIXELS),
    default=default_of(TokenizeConfig, "max_image_pixels"),
    show_default=True,
    help="Images with more pixels (width x height) become image_too_large error rows (decompression bombs); "
    "the default and maximum is where PIL, which training decodes with, refuses.",
)
@click.option(
    "--media-root",
    "media_roots",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="Read media only inside this directory (repeatable): a media path that resolves elsewhere (.., absolute, "
    "a symlink) becomes a media_outside_root error row. For data you did not make.",
)
@executor_options
def tokenize_command(executor: ExecutorConfig, **options: object) -> None:
    """Pretokenize ShareGPT conversations with exact text + media token counts."""
    from prep.tokenize.stage import run_tokenize
    from prep.tokenize.summary import format_summary

    options["datasets"] = tuple(options["datasets"])  # type: ignore[arg-type]
    options["media_roots"] = tuple(options["media_roots"])  # type: ignore[arg-type]
    manifest = run_tokenize(TokenizeConfig(executor=executor, **options))  # type: ignore[arg-type]
    click.echo(format_summary(manifest))
