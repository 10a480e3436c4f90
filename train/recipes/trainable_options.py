"""The flags that choose what `train hf` trains: ``--freeze`` and ``--lora-*`` (defaults from the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from packvlm.cli import default_of
from train.lora import LORA_EXPORTS
from train.trainable import GROUPS

F = TypeVar("F", bound=Callable[..., Any])


def _split_targets(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


def trainable_options(config_cls: type) -> Callable[[F], F]:
    """Decorator adding ``--freeze`` (repeatable) and the ``--lora-*`` flags."""

    def default(name: str) -> Any:
        return default_of(config_cls, name)

    options = [
        click.option(
            "--freeze",
            type=click.Choice(GROUPS),
            multiple=True,
            default=default("freeze"),
            help="Keep this part as loaded (no gradient, no optimizer state); repeatable: --freeze vision "
            "--freeze projector. audio: the Omni thinkers' audio tower.",
        ),
        click.option(
            "--lora-rank",
            type=click.IntRange(min=0),
            default=default("lora_rank"),
            show_default=True,
            help="Train LoRA adapters of this rank on the language model instead of the weights (needs peft: "
            "pip install 'packvlm[lora]'); 0: full fine-tuning.",
        ),
        click.option(
            "--lora-alpha",
            type=click.FloatRange(min=0, min_open=True),
            default=default("lora_alpha"),
            help="LoRA scale numerator (scale = alpha / rank)  [default: 2 x rank]",
        ),
        click.option(
            "--lora-targets",
            callback=_split_targets,
            default=None,
            help="Comma-separated linear layer names inside the language model, e.g. q_proj,v_proj  "
            "[default: every linear layer of its decoder layers]",
        ),
        click.option(
            "--lora-export",
            type=click.Choice(LORA_EXPORTS),
            default=default("lora_export"),
            show_default=True,
            help="Checkpoints hold the adapter; merged: the end of the run also writes OUT/merged, the adapters "
            "folded into a plain transformers model.",
        ),
    ]

    def wrap(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return wrap
