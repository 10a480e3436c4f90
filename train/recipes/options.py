"""The flags both `train` recipes share, declared once (their defaults come from each recipe's config).

Each recipe's config has the fields of `train.loader.LoaderOptions` plus ``output``, ``max_steps``,
``grad_accum`` and ``lr``; `shared_options` adds their flags to a command, so the two commands
cannot drift apart on what ``--sampling`` or ``--packs-per-microbatch`` mean.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from packvlm.cli import default_of
from train.loader import SAMPLINGS
from train.media import PIXEL_WIRES

F = TypeVar("F", bound=Callable[..., Any])
PATH = click.Path(path_type=Path)


def shared_options(config_cls: type) -> Callable[[F], F]:
    """Decorator adding the data, run-directory and step flags, defaults read from ``config_cls``."""

    def default(name: str) -> Any:
        return default_of(config_cls, name)

    options = [
        click.option("--data", type=PATH, required=True, help="`prep pack` output indexed by `prep energon-index`."),
        click.option(
            "--processor", type=PATH, required=True, help="Processor directory the shards were tokenized with."
        ),
        click.option("--output", type=PATH, required=True, help="Run directory: metrics.jsonl, train.log, ..."),
        click.option("--max-steps", type=click.IntRange(min=1), required=True, help="Optimizer steps."),
        click.option("--lr", type=float, default=default("lr"), show_default=True, help="Peak AdamW learning rate."),
        click.option(
            "--grad-accum",
            type=click.IntRange(min=1),
            default=default("grad_accum"),
            show_default=True,
            help="Micro-batches per rank per optimizer step.",
        ),
        click.option(
            "--packs-per-microbatch",
            type=click.IntRange(min=1),
            default=default("packs_per_microbatch"),
            show_default=True,
            help="Packs concatenated into one THD row.",
        ),
        click.option("--seed", type=int, default=default("seed"), show_default=True, help="Init and data-order seed."),
        click.option(
            "--num-workers",
            type=click.IntRange(min=0),
            default=default("num_workers"),
            show_default=True,
            help="Loader worker processes per rank.",
        ),
        click.option(
            "--sampling",
            type=click.Choice(SAMPLINGS),
            default=default("sampling"),
            show_default=True,
            help="epoch: every pack exactly once per epoch across ranks and workers, in a seeded order that differs "
            "per epoch; buffer: Energon's streaming shuffle buffer (epochs overlap).",
        ),
        click.option(
            "--shuffle-buffer-size",
            type=click.IntRange(min=0),
            default=default("shuffle_buffer_size"),
            show_default=True,
            help="Energon sample shuffle buffer (packs), with --sampling buffer.",
        ),
        click.option(
            "--pixels",
            type=click.Choice(PIXEL_WIRES),
            default=default("pixels"),
            show_default=True,
            help="Image pixels from the loader workers: uint8 (a quarter of the bytes; the processor's floats made "
            "on the device, bit-equal) or float32 (the processor's output as it is).",
        ),
    ]

    def wrap(command: F) -> F:
        for option in reversed(options):  # click lists them in the order above
            command = option(command)
        return command

    return wrap
