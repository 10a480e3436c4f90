"""``prep example OUT_DIR``: write the offline quickstart dataset and processor.

Example::

    prep example /tmp/demo --num-samples 64
    prep tokenize --config /tmp/demo/dataset_info.json --processor /tmp/demo/processor ...
    train hf --model /tmp/demo/model ...   # config only: random init with --seed
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from families.registry import example_families
from prep.example.dataset import write_example_dataset

logger = logging.getLogger(__name__)


@click.command("example")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--num-samples",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Good rows in the 'chat' dataset.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the filler rows.")
@click.option(
    "--family",
    type=click.Choice(example_families()),
    default="qwen2_vl",
    show_default=True,
    help="Family of OUT_DIR/processor and of the tiny random-init model config in OUT_DIR/model (matching it).",
)
@click.option(
    "--bad-rows/--no-bad-rows",
    default=True,
    show_default=True,
    help="Include one bad row per error reason.",
)
@click.option(
    "--parquet/--no-parquet",
    default=False,
    show_default=True,
    help="Also write the 'chat' rows as a datasets-style Parquet file with embedded image bytes ('chat_parquet').",
)
def example_command(out_dir: Path, num_samples: int, seed: int, family: str, bad_rows: bool, parquet: bool) -> None:
    """Write a tiny offline processor (Qwen2-VL by default), its model config and a multimodal ShareGPT dataset."""
    config_path = write_example_dataset(
        out_dir, num_samples=num_samples, seed=seed, with_bad_rows=bad_rows, family=family
    )
    if parquet:
        from prep.example.parquet import add_parquet_entry

        logger.info("parquet: %s", add_parquet_entry(config_path))
    logger.info("dataset config: %s", config_path)
    logger.info("processor: %s", out_dir / "processor")
    if (out_dir / "model").is_dir():
        logger.info("model config (random init): %s", out_dir / "model")
    click.echo(str(config_path))
