"""The `train` command group: `train hf` here, `train megatron` from its own package."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from prep.cli_errors import ErrorMappingGroup, debug_option
from prep.cli_options import default_of
from train.loader import SAMPLINGS
from train.loops.hf import HFTrainConfig, run


class TrainGroup(ErrorMappingGroup):
    """Every failure is one line and one exit code (`packvlm.errors`), not a traceback."""


def _default(name: str) -> Any:
    """The default of an HFTrainConfig field: defaults live only in the config class."""
    return default_of(HFTrainConfig, name)


@click.group(cls=TrainGroup)
@click.version_option(package_name="packvlm")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@debug_option
def main(verbose: bool, debug: bool) -> None:
    """packvlm training on `prep pack` shards: exact packed (THD / varlen) micro-batches."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


_PATH = click.Path(path_type=Path)


@main.command("hf")
@click.option("--data", type=_PATH, required=True, help="`prep pack` output indexed by `prep energon-index`.")
@click.option(
    "--model",
    type=_PATH,
    required=True,
    help="HF model directory; with weights they are loaded, config-only means random init with --seed.",
)
@click.option("--processor", type=_PATH, required=True, help="Processor directory the shards were tokenized with.")
@click.option("--output", type=_PATH, required=True, help="Run directory: metrics.jsonl, checkpoints/.")
@click.option("--max-steps", type=click.IntRange(min=1), required=True, help="Optimizer steps.")
@click.option("--lr", type=float, default=_default("lr"), show_default=True, help="Peak AdamW learning rate.")
@click.option("--weight-decay", type=float, default=_default("weight_decay"), show_default=True)
@click.option("--warmup-steps", type=click.IntRange(min=0), default=_default("warmup_steps"), show_default=True)
@click.option(
    "--lr-schedule",
    default=_default("lr_schedule"),
    show_default=True,
    help="transformers.get_scheduler name: cosine, linear, constant_with_warmup, ...",
)
@click.option("--max-grad-norm", type=float, default=_default("max_grad_norm"), show_default=True)
@click.option(
    "--grad-accum",
    type=click.IntRange(min=1),
    default=_default("grad_accum"),
    show_default=True,
    help="Micro-batches per rank per optimizer step.",
)
@click.option(
    "--packs-per-microbatch",
    type=click.IntRange(min=1),
    default=_default("packs_per_microbatch"),
    show_default=True,
    help="Packs concatenated into one THD row.",
)
@click.option("--seed", type=int, default=_default("seed"), show_default=True, help="Init and data-order seed.")
@click.option(
    "--save-every",
    type=click.IntRange(min=0),
    default=_default("save_every"),
    show_default=True,
    help="Checkpoint every N steps (0: only at the end).",
)
@click.option(
    "--stop-after",
    type=click.IntRange(min=1),
    default=_default("stop_after"),
    help="Checkpoint and exit after this step (e.g. a job's time slot); --resume continues the same schedule.",
)
@click.option("--resume", is_flag=True, help="Continue from OUT's latest checkpoint, exactly.")
@click.option("--device", default=_default("device"), show_default=True, help="auto, cpu or cuda.")
@click.option(
    "--num-workers",
    type=click.IntRange(min=0),
    default=_default("num_workers"),
    show_default=True,
    help="Loader worker processes per rank.",
)
@click.option(
    "--sampling",
    type=click.Choice(SAMPLINGS),
    default=_default("sampling"),
    show_default=True,
    help="epoch: every pack exactly once per epoch across ranks and workers, in a seeded order that differs per "
    "epoch; buffer: Energon's streaming shuffle buffer (epochs overlap).",
)
@click.option(
    "--shuffle-buffer-size",
    type=click.IntRange(min=0),
    default=_default("shuffle_buffer_size"),
    show_default=True,
    help="Energon sample shuffle buffer (packs), with --sampling buffer.",
)
def hf_command(**options: Any) -> None:
    """Train a Hugging Face model (AutoModelForImageTextToText or causal LM) on packed micro-batches.

    \b
    train hf --data ./example-out/packed --model ./example-data/model \\
        --processor ./example-data/processor --output ./example-out/run --max-steps 30
    torchrun --nproc_per_node 2 -m train.cli hf ...   # one process per device
    """
    history = run(HFTrainConfig(**options))
    if history and int(os.environ.get("RANK", "0")) == 0:
        last = history[-1]
        click.echo(
            f"trained steps {history[0].step}..{last.step}: loss {history[0].loss:.4f} -> {last.loss:.4f}, "
            f"{sum(m.num_real_tokens for m in history):,} tokens, last {last.tokens_per_s:,.0f} tokens/s, "
            f"real-token fraction {100 * last.real_token_fraction:.2f}%; metrics and checkpoints in {options['output']}"
        )


def _add_megatron() -> None:
    from train.megatron.cli import megatron_command

    main.add_command(megatron_command)


_add_megatron()


if __name__ == "__main__":
    main()
