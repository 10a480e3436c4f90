"""The flags of `prep pack` -> `PackConfig`; `prep.pipeline` holds the command (it runs pack, then shards)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from packvlm.cli import default_of
from prep.pack.shard_cut import ShardSize, ShardSizeError, parse_shard_size
from prep.pack.stage import OVERSIZE_POLICIES, PackConfig
from schemas.splits import SplitRatio, SplitRatioError, parse_split_ratio

F = TypeVar("F", bound=Callable[..., Any])


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


PACK_OPTIONS = (
    click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False)),
    click.option(
        "--output", "output_dir", required=True, type=click.Path(file_okay=False), help="Output directory (resumable)."
    ),
    click.option("--pack-size", required=True, type=click.IntRange(min=1), help="Tokens per pack."),
    click.option(
        "--max-samples-per-pack",
        type=click.IntRange(min=1),
        default=_default("max_samples_per_pack"),
        help="Cap on samples per pack.",
    ),
    click.option(
        "--seed", type=int, default=_default("seed"), show_default=True, help="Seed of the pack order shuffle."
    ),
    click.option(
        "--pad-to-multiple-of",
        type=click.IntRange(min=1),
        default=_default("pad_to_multiple_of"),
        show_default=True,
        help="Round each sample's slot up to this (context parallelism).",
    ),
    click.option(
        "--oversize",
        type=click.Choice(OVERSIZE_POLICIES),
        default=_default("oversize"),
        show_default=True,
        help="Samples longer than a pack: report and drop, or fail.",
    ),
    click.option(
        "--max-oversize-rate",
        type=click.FloatRange(0, 1),
        default=_default("max_oversize_rate"),
        show_default=True,
        help="With --oversize drop: fail when more than this fraction of samples exceeds --pack-size.",
    ),
    click.option(
        "--balance-media",
        is_flag=True,
        default=_default("balance_media"),
        help="Order packs so each group of --media-group-size carries similar media loads.",
    ),
    click.option(
        "--media-group-size",
        type=click.IntRange(min=1),
        default=_default("media_group_size"),
        show_default=True,
        help="Packs per training step across data-parallel ranks.",
    ),
    click.option(
        "--shard-size",
        type=ShardSizeType(),
        default=str(_default("shard_size")),
        show_default=True,
        help="Target shard size: bytes (512MB, 1GiB) or packs (1000packs).",
    ),
    click.option(
        "--split-ratio",
        type=SplitRatioType(),
        default=_default("split_ratio"),
        help="train,val,test share of packs, e.g. 0.98,0.02,0: packs split in plan order, shards cut at split "
        "boundaries (default: every pack in train).",
    ),
)


def pack_options(command: F) -> F:
    """Adds the flags that make a `PackConfig` (`pack_config`), defaults read from it."""
    for option in reversed(PACK_OPTIONS):  # click lists them in the order above
        command = option(command)
    return command


def pack_config(options: dict[str, Any]) -> PackConfig:
    """The `PackConfig` of the flags `pack_options` added."""
    return PackConfig(**{**options, "inputs": tuple(options["inputs"])})
