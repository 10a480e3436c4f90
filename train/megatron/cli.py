"""`train megatron`: flags -> MegatronTrainConfig -> train.megatron.loop.run."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from prep.cli_options import default_of
from train.megatron.loop import MegatronTrainConfig


@click.command("megatron")
@click.option(
    "--data",
    required=True,
    type=click.Path(path_type=Path),
    help="`prep pack` output indexed by `prep energon-index`.",
)
@click.option(
    "--processor",
    required=True,
    type=click.Path(path_type=Path),
    help="The HF processor the data was tokenized with (its tokenizer sets the vocabulary size).",
)
@click.option("--output", required=True, type=click.Path(path_type=Path), help="Run directory (metrics, model.pt).")
@click.option(
    "--model-config",
    type=click.Path(path_type=Path),
    default=None,
    help="HF model directory (config.json) the loader reads for Qwen-VL rope indices (default: --processor).",
)
@click.option(
    "--num-layers", type=click.IntRange(min=1), default=default_of(MegatronTrainConfig, "num_layers"), show_default=True
)
@click.option(
    "--hidden-size",
    type=click.IntRange(min=8),
    default=default_of(MegatronTrainConfig, "hidden_size"),
    show_default=True,
)
@click.option(
    "--num-attention-heads",
    type=click.IntRange(min=1),
    default=default_of(MegatronTrainConfig, "num_attention_heads"),
    show_default=True,
)
@click.option("--max-steps", required=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option(
    "--lr", type=float, default=default_of(MegatronTrainConfig, "lr"), show_default=True, help="AdamW learning rate."
)
@click.option(
    "--seed",
    type=int,
    default=default_of(MegatronTrainConfig, "seed"),
    show_default=True,
    help="Model init and loader shuffle seed.",
)
@click.option(
    "--packs-per-microbatch",
    type=click.IntRange(min=1),
    default=default_of(MegatronTrainConfig, "packs_per_microbatch"),
    show_default=True,
    help="Packs per THD row.",
)
@click.option(
    "--grad-accum",
    type=click.IntRange(min=1),
    default=default_of(MegatronTrainConfig, "grad_accum"),
    show_default=True,
    help="Micro-batches per step and rank.",
)
@click.option(
    "--ignore-media",
    is_flag=True,
    help="Train on packs with images/videos as text (placeholder tokens embedded like any token).",
)
@click.option(
    "--num-workers",
    type=click.IntRange(min=0),
    default=default_of(MegatronTrainConfig, "num_workers"),
    show_default=True,
    help="Loader workers.",
)
def megatron_command(**options: object) -> None:
    """Train a megatron-core GPT model (Transformer Engine spec) on the packed THD micro-batches.

    Text only: the language model sees the packed tokens; the VLM vision encoder is not built
    on the Megatron side, so packs holding images or videos are refused unless --ignore-media.
    Needs a CUDA GPU, megatron-core and Transformer Engine (pip install 'packvlm[megatron]'
    plus transformer_engine[pytorch]); without them it stops at once and says what to
    install. Alone or under torchrun: tensor/pipeline parallel 1, data parallel = GPUs.
    """
    from train.megatron.loop import run

    if not logging.getLogger().handlers:  # the step log lines; the `train` group may have set this up
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run(MegatronTrainConfig(**options))  # type: ignore[arg-type]  # the `train` group maps its errors to exit codes
