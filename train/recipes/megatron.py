"""`train megatron`: packed THD micro-batches through a megatron-core GPT model: config, command, loop.

One process per GPU, alone or under ``torchrun`` (tensor and pipeline parallel size 1, data
parallel = world size). Each optimizer step takes ``grad_accum`` micro-batches per rank from
the Energon loader, runs `train.megatron.step.forward_step` on each (Megatron-LM's step:
pre-shifted labels, loss mask, ``PackedSeqParams``), back-propagates the **summed** token
loss, then - as megatron-core does with ``calculate_per_token_loss`` - sums gradients and
token counts over ranks and divides the gradients by the label tokens of the whole global
batch. AdamW, gradient clipping, bf16 autocast over fp32 weights.

Text only: the model is a language model over the packed tokens; the VLM vision encoder is
not built on the Megatron side. Packs holding images or videos are refused (naming the pack)
unless ``ignore_media`` is set, in which case their placeholder tokens are trained on as
ordinary tokens and the pixels are ignored.

What a run leaves: ``OUT/_run.json`` (options, `train.run_dir`), ``OUT/train.log``,
``OUT/metrics.jsonl`` (one `train.metrics.StepMetrics` line per step, as `train hf` writes) and
``OUT/model.pt`` (the final ``state_dict`` of the megatron-core model, rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

from packvlm.atomic import atomic_path
from packvlm.errors import UsageError
from prep.cli_options import default_of
from prep.tokenize.processor import load_processor
from schemas.train import LOG_FILE, METRICS_FILE
from train.batch import PackedBatch
from train.dataset import TrainConfigError
from train.distributed import DistContext, all_reduce_grads, all_reduce_sum, init_distributed
from train.loader import Sampling, make_loader, rank_loader_config, validate_loader_config
from train.megatron.model import GPTConfig, build_gpt_model, require_megatron_gpu
from train.megatron.step import forward_step
from train.metrics import MetricsWriter, StepMetrics, collect_step_metrics
from train.recipes.options import PATH, shared_options
from train.run_dir import attach_log_file, claim_run_dir, config_fingerprint, detach_log_file

log = logging.getLogger(__name__)
MODEL_FILE = "model.pt"


class MediaInPackError(UsageError, ValueError):
    """A micro-batch holds images or videos, which the text-only Megatron path cannot encode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronTrainConfig:
    """Every option of `train megatron`; the click flags take their defaults from here."""

    data: Path
    processor: Path
    output: Path
    max_steps: int
    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    packs_per_microbatch: int = 1
    grad_accum: int = 1
    ignore_media: bool = False
    model_config: Path | None = None  # HF config dir for the loader's Qwen-VL rope index
    num_workers: int = 2
    sampling: Sampling = "epoch"  # every pack once per epoch; "buffer": Energon's streaming shuffle buffer
    shuffle_buffer_size: int = 100  # with sampling "buffer"

    def fingerprint(self) -> dict[str, Any]:
        """Every option: a run directory holds one run (no --resume yet)."""
        return config_fingerprint(self)


def _default(name: str) -> Any:
    """The default of a MegatronTrainConfig field: defaults live only in the config class."""
    return default_of(MegatronTrainConfig, name)


@click.command("megatron")
@shared_options(MegatronTrainConfig)
@click.option(
    "--model-config",
    type=PATH,
    default=None,
    help="HF model directory (config.json) the loader reads for Qwen-VL rope indices (default: --processor).",
)
@click.option("--num-layers", type=click.IntRange(min=1), default=_default("num_layers"), show_default=True)
@click.option("--hidden-size", type=click.IntRange(min=8), default=_default("hidden_size"), show_default=True)
@click.option(
    "--num-attention-heads", type=click.IntRange(min=1), default=_default("num_attention_heads"), show_default=True
)
@click.option("--max-grad-norm", type=float, default=_default("max_grad_norm"), show_default=True)
@click.option(
    "--ignore-media",
    is_flag=True,
    help="Train on packs with images/videos as text (placeholder tokens embedded like any token).",
)
def megatron_command(**options: Any) -> None:
    """Train a megatron-core GPT model (Transformer Engine spec) on the packed THD micro-batches.

    Text only: the language model sees the packed tokens; the VLM vision encoder is not built
    on the Megatron side, so packs holding images or videos are refused unless --ignore-media.
    Needs a CUDA GPU, megatron-core and Transformer Engine (pip install 'packvlm[megatron]'
    plus transformer_engine[pytorch]); without them it stops at once and says what to
    install. Alone or under torchrun: tensor/pipeline parallel 1, data parallel = GPUs.
    """
    if not logging.getLogger().handlers:  # the step log lines; the `train` group may have set this up
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run(MegatronTrainConfig(**options))  # the `train` group maps its errors to exit codes


def run(config: MegatronTrainConfig) -> list[StepMetrics]:
    """Train for ``config.max_steps`` steps; returns this process's `StepMetrics`.

    Raises:
        MegatronNotInstalledError: no CUDA, megatron-core or Transformer Engine (checked first).
    """
    require_megatron_gpu()
    from megatron.core import parallel_state, tensor_parallel

    ctx = init_distributed("cuda")
    torch.cuda.set_device(ctx.device)
    if not dist.is_initialized():  # a single process: megatron's parallel state needs a group
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        torch.manual_seed(config.seed)
        return _train(config, ctx)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        detach_log_file(config.output / LOG_FILE)


def _train(config: MegatronTrainConfig, ctx: DistContext) -> list[StepMetrics]:
    model_dir = str(_model_config_dir(config))  # its config gives the rope rule; no weights read
    loader_config = rank_loader_config(config, model=model_dir, rank=ctx.rank, world_size=ctx.world_size)
    info = validate_loader_config(loader_config)  # fail fast, before a model is built
    claim_run_dir(
        config.output,
        fingerprint=config.fingerprint(),
        command="train megatron",
        resume=False,
        ctx=ctx,
        subdirs=(),
        resumable=False,
    )
    if ctx.is_main:
        attach_log_file(config.output / LOG_FILE)
    model = build_gpt_model(
        GPTConfig(
            vocab_size=len(load_processor(str(config.processor)).tokenizer),
            max_sequence_length=info.pack_size * config.packs_per_microbatch,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
        )
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    log.info(
        "train megatron: %s (%d packs of %d tokens) on %d GPU(s), GPT %d layers x %d hidden, %s parameters",
        info.path,
        info.num_packs,
        info.pack_size,
        ctx.world_size,
        config.num_layers,
        config.hidden_size,
        f"{sum(p.numel() for p in model.parameters()):,}",
    )
    batches = text_only(make_loader(loader_config, validate=False), ignore_media=config.ignore_media)
    writer = MetricsWriter(config.output / METRICS_FILE)
    history = []
    for step in range(1, config.max_steps + 1):
        micro = [next(batches) for _ in range(config.grad_accum)]
        metrics = train_step(model, optimizer, micro, ctx, step=step, max_grad_norm=config.max_grad_norm)
        history.append(metrics)
        if ctx.is_main:
            writer.write(metrics)
            log.info(metrics.log_line(config.max_steps))
    if ctx.is_main:
        with atomic_path(config.output / MODEL_FILE) as tmp:
            torch.save(model.state_dict(), tmp)
    return history


def _model_config_dir(config: MegatronTrainConfig) -> Path:
    """The HF model directory whose config.json drives the loader's rope index."""
    if config.model_config is not None:
        return config.model_config
    if (config.processor / "config.json").is_file():
        return config.processor
    raise TrainConfigError(
        f"--processor {config.processor} holds no config.json: pass --model-config with the HF model directory "
        "(config.json only is enough; for `prep example` data: OUT/model). The loader reads it for the model "
        "family's rotary-position rule; no weights are loaded."
    )


def text_only(batches: Iterable[PackedBatch], *, ignore_media: bool) -> Iterator[PackedBatch]:
    """``batches`` unchanged; a micro-batch with media raises unless ``ignore_media``.

    Raises:
        MediaInPackError: naming the packs and the flag.
    """
    for batch in batches:
        if batch.num_media and not ignore_media:
            raise MediaInPackError(
                f"packs {', '.join(batch.pack_keys)} hold {batch.num_media} images/videos, but `train megatron` "
                "trains the language model only (no vision encoder on the Megatron side). Pass --ignore-media to "
                "train on their tokens as text, pack text-only data, or use `train hf` for the full VLM."
            )
        yield batch


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro: list[PackedBatch],
    ctx: DistContext,
    *,
    step: int,
    max_grad_norm: float,
) -> StepMetrics:
    """One optimizer step: summed losses back-propagated, gradients / global label tokens."""
    started = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    local_tokens = 0
    for batch in micro:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output, loss_fn = forward_step(iter([batch]), model)
        loss, num_tokens, _ = loss_fn(output)
        loss.backward()
        loss_sum += loss.detach()
        local_tokens += int(num_tokens)
    global_tokens = int(all_reduce_sum(local_tokens, ctx))
    all_reduce_grads(model, ctx, divide_by=max(global_tokens, 1))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return collect_step_metrics(
        step=step,
        micro=micro,
        ctx=ctx,
        loss_sum=float(loss_sum),
        num_label_tokens=global_tokens,
        lr=float(optimizer.param_groups[0]["lr"]),
        grad_norm=float(grad_norm),
        started=started,
    )


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
