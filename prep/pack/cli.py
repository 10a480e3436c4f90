"""`prep pack`: flags -> PackConfig -> plan, then the shards stage on it (`prep.pipeline`)."""

from __future__ import annotations

import click

from packvlm.cli import default_of
from prep.cli_options import executor_options
from prep.pack.shard_cut import ShardSize, ShardSizeError, parse_shard_size
from prep.pack.stage import OVERSIZE_POLICIES, PackConfig
from prep.run import ExecutorConfig
from schemas.splits import SplitRatio, SplitRatioError, parse_split_ratio


class ShardSizeType(click.ParamType):
    """``512MB`` / ``1GiB`` / ``4096`` (bytes) or ``1000packs``, parsed once into a ShardSize."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> ShardSize:
        if isinstance(value, ShardSize):
            return value
        try:
            return parse_shard_size(str(value))
        except ShardSizeError as exc:
            self.fail(str(exc), param, ctx)


class SplitRatioType(click.ParamType):
    """``train,val,test`` like ``0.98,0.02,0``, parsed once into three floats."""

    name = "train,val,test"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> SplitRatio:
        if isinstance(value, tuple):
            return value  # already parsed (a default)
        try:
            return parse_split_ratio(str(value))
        except SplitRatioError as exc:
            self.fail(str(exc), param, ctx)


def _default(name: str) -> object:
    return default_of(PackConfig, name)


@click.command("pack")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--output", "output_dir", required=True, type=click.Path(file_okay=False), help="Output directory (resumable)."
)
@click.option("--pack-size", required=True, type=click.IntRange(min=1), help="Tokens per pack.")
@click.option(
    "--max-samples-per-pack",
    type=click.IntRange(min=1),
    default=_default("max_samples_per_pack"),
    help="Cap on samples per pack.",
)
@click.option("--seed", type=int, default=_default("seed"), show_default=True, help="Seed of the pack order shuffle.")
@click.option(
    "--pad-to-multiple-of",
    type=click.IntRange(min=1),
    default=_default("pad_to_multiple_of"),
    show_default=True,
    help="Round each sample's slot up to this (context parallelism).",
)
@click.option(
    "--oversize",
    type=click.Choice(OVERSIZE_POLICIES),
    default=_default("oversize"),
    show_default=True,
    help="Samples longer than a pack: report and drop, or fail.",
)
@click.option(
    "--max-oversize-rate",
    type=click.FloatRange(0, 1),
    default=_default("max_oversize_rate"),
    show_default=True,
    help="With --oversize drop: fail when more than this fraction of samples exceeds --pack-size.",
)
@click.option(
    "--balance-media",
    is_flag=True,
    default=_default("balance_media"),
    help="Order packs so each group of --media-group-size carries similar media loads.",
)
@click.option(
    "--media-group-size",
    type=click.IntRange(min=1),
    default=_default("media_group_size"),
    show_default=True,
    help="Packs per training step across data-parallel ranks.",
)
@click.option(
    "--shard-size",
    type=ShardSizeType(),
    default=str(_default("shard_size")),
    show_default=True,
    help="Target shard size: bytes (512MB, 1GiB) or packs (1000packs).",
)
@click.option(
    "--split-ratio",
    type=SplitRatioType(),
    default=_default("split_ratio"),
    help="train,val,test share of packs, e.g. 0.98,0.02,0: packs split in plan order, shards cut at split "
    "boundaries (default: every pack in train).",
)
@click.option("--plan-only", is_flag=True, help="Write plan.arrow and the manifest; run `prep shards` later.")
@executor_options
def pack_command(plan_only: bool, executor: ExecutorConfig, **options: object) -> None:
    """Pack tokenized samples (INPUTS: `prep tokenize` outputs) into webdataset shards."""
    from prep.pack.stats import format_summary
    from prep.pipeline import pack_and_shard

    options["inputs"] = tuple(options["inputs"])  # type: ignore[arg-type]
    config = PackConfig(**options)  # type: ignore[arg-type]
    manifest, shards = pack_and_shard(config, executor, plan_only=plan_only)
    click.echo(format_summary(manifest, shards, config.output_dir))
