"""`train megatron`: packed THD micro-batches through a megatron-core GPT model: config, command, loop.

One process per GPU, alone or under ``torchrun``: tensor and pipeline parallel size 1, context
parallel ``--context-parallel-size`` (c), data parallel = world size / c. Each optimizer step
takes ``grad_accum`` micro-batches per data-parallel rank from the Energon loader (context-parallel
peers read the same packs and each keeps its chunks of every sample, `train.context_parallel`),
runs a Megatron-LM step on each (pre-shifted labels, loss mask, ``PackedSeqParams``),
back-propagates the **summed** token loss, then - as megatron-core does with
``calculate_per_token_loss`` - sums gradients and token counts over all ranks and divides the
gradients by the label tokens of the whole global batch. AdamW, gradient clipping, bf16 autocast
over fp32 weights.

Which model (decided once, from ``--model-config``'s HF config):

- a supported VLM family (`train.megatron.vision.SUPPORTED_MODEL_TYPES`: Qwen2/2.5-VL with mRoPE,
  Mistral 3, Pixtral, LLaVA-OneVision / NeXT with 1-D rope) and no ``--ignore-media``:
  `train.megatron.vlm.MegatronVLM`, a GPTModel as wide as the HF text config, ``--num-layers``
  deep, with the family's own HF vision tower + projector writing the image rows of
  ``decoder_input``: **images are trained**;
- otherwise a GPTModel sized by the flags; packs holding images or videos are refused (naming
  the pack and why) unless ``--ignore-media``, which trains their placeholder tokens as ordinary
  tokens and ignores the pixels.

What a run leaves: ``OUT/_run.json`` (options, `train.run_dir`), ``OUT/train.log``,
``OUT/metrics.jsonl`` (one `train.metrics.StepMetrics` line per step, as `train hf` writes) and
``OUT/model.pt`` (the final ``state_dict``, rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist

from families.processor import load_processor
from packvlm.atomic import atomic_path
from packvlm.cli import default_of
from packvlm.errors import UsageError
from schemas.train import LOG_FILE, METRICS_FILE
from train.batch import PackedBatch
from train.dataset import TrainConfigError
from train.distributed import DistContext, all_reduce_grads, all_reduce_sum, init_distributed
from train.identity import load_model_config
from train.loader import LoaderConfig, Sampling, make_loader, rank_loader_config, validate_loader_config
from train.media import PixelWire
from train.megatron.model import GPTConfig, build_gpt_model, require_megatron_gpu, vlm_gpt_config
from train.megatron.step import forward_step
from train.megatron.vision import HFVisionEncoder, unsupported_reason, vision_rope
from train.megatron.vlm import MegatronVLM, vlm_forward_step
from train.metrics import MetricsWriter, StepMetrics, collect_step_metrics
from train.recipes.options import PATH, shared_options
from train.run_dir import attach_log_file, claim_run_dir, config_fingerprint, detach_log_file

log = logging.getLogger(__name__)
MODEL_FILE = "model.pt"


TEXT_HIDDEN_SIZE = 256  # the text-only GPT's width when --hidden-size is not given
TEXT_ATTENTION_HEADS = 4
StepFn = Callable[[Iterator[PackedBatch], torch.nn.Module], Any]


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
    hidden_size: int | None = None  # text: TEXT_HIDDEN_SIZE; with images: the HF text config's (must match)
    num_attention_heads: int | None = None  # text: TEXT_ATTENTION_HEADS; with images: the HF text config's
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = default_of(LoaderConfig, "seed")
    packs_per_microbatch: int = default_of(LoaderConfig, "packs_per_microbatch")
    grad_accum: int = 1
    ignore_media: bool = False
    model_config: Path | None = None  # HF config dir for the loader's Qwen-VL rope index
    # the loader's options: their defaults are LoaderConfig's (train.loader)
    num_workers: int = default_of(LoaderConfig, "num_workers")
    sampling: Sampling = default_of(LoaderConfig, "sampling")
    pixels: PixelWire = default_of(LoaderConfig, "pixels")
    shuffle_buffer_size: int = default_of(LoaderConfig, "shuffle_buffer_size")
    context_parallel_size: int = 1  # slots must be multiples of 2x this (prep pack --pad-to-multiple-of)

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
@click.option(
    "--hidden-size",
    type=click.IntRange(min=8),
    default=None,
    help=f"Text-only GPT width [default: {TEXT_HIDDEN_SIZE}]; with images the HF text config's (a different value "
    "is refused).",
)
@click.option(
    "--num-attention-heads",
    type=click.IntRange(min=1),
    default=None,
    help=f"Text-only GPT heads [default: {TEXT_ATTENTION_HEADS}]; with images the HF text config's.",
)
@click.option(
    "--context-parallel-size",
    type=click.IntRange(min=1),
    default=_default("context_parallel_size"),
    show_default=True,
    help="GPUs sharing each micro-batch (every sample cut into 2x this many chunks); packs need "
    "`prep pack --pad-to-multiple-of 2x` it.",
)
@click.option("--max-grad-norm", type=float, default=_default("max_grad_norm"), show_default=True)
@click.option(
    "--ignore-media",
    is_flag=True,
    help="Train the text only: placeholder tokens embedded like any token, pixels ignored, no vision tower.",
)
def megatron_command(**options: Any) -> None:
    """Train a megatron-core GPT model (Transformer Engine spec) on the packed THD micro-batches.

    With images: for Qwen2/2.5-VL (mRoPE), Mistral 3, Pixtral and LLaVA-OneVision/NeXT the
    family's own Hugging Face vision tower and projector embed the images into the language
    model's input at the image-token positions; other families train text only (media refused
    unless --ignore-media). Needs a CUDA GPU, megatron-core and Transformer Engine (pip install
    'packvlm[megatron]' plus transformer_engine[pytorch]); without them it stops at once and
    says what to install. Alone or under torchrun: tensor/pipeline parallel 1, context parallel
    --context-parallel-size, data parallel = GPUs / context parallel.
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
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=config.context_parallel_size,
    )
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        torch.manual_seed(config.seed)
        return _train(config, ctx)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        detach_log_file(config.output / LOG_FILE)


def _train(config: MegatronTrainConfig, ctx: DistContext) -> list[StepMetrics]:
    from megatron.core import parallel_state

    model_dir = str(_model_config_dir(config))  # its config gives the rope rule and the vision tower
    cp_size, cp_rank = config.context_parallel_size, parallel_state.get_context_parallel_rank()
    loader_config = rank_loader_config(  # context-parallel peers read the same packs
        config,
        model=model_dir,
        rank=parallel_state.get_data_parallel_rank(),
        world_size=parallel_state.get_data_parallel_world_size(),
        context_parallel_size=cp_size,
    )
    info = validate_loader_config(loader_config)  # fail fast, before a model is built
    plan = plan_model(config, load_model_config(model_dir))
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
    vocab_size = len(load_processor(str(config.processor)).tokenizer)
    max_sequence_length = info.pack_size * config.packs_per_microbatch
    model, step_fn = _build(config, plan, vocab_size, max_sequence_length, cp_rank)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    log.info(
        "train megatron: %s (%d packs of %d tokens) on %d GPU(s) (context parallel %d), %s, %s parameters",
        info.path,
        info.num_packs,
        info.pack_size,
        ctx.world_size,
        cp_size,
        plan.describe(config.num_layers),
        f"{sum(p.numel() for p in model.parameters()):,}",
    )
    loader = make_loader(loader_config, validate=False)
    batches = loader if plan.vision else text_only(loader, ignore_media=config.ignore_media, reason=plan.text_reason)
    writer = MetricsWriter(config.output / METRICS_FILE)
    history = []
    for step in range(1, config.max_steps + 1):
        micro = [next(batches) for _ in range(config.grad_accum)]
        metrics = train_step(
            model,
            optimizer,
            micro,
            ctx,
            step=step,
            max_grad_norm=config.max_grad_norm,
            step_fn=step_fn,
            report=cp_rank == 0,  # context-parallel peers hold the same micro-batches: count them once
        )
        history.append(metrics)
        if ctx.is_main:
            writer.write(metrics)
            log.info(metrics.log_line(config.max_steps))
    if ctx.is_main:
        with atomic_path(config.output / MODEL_FILE) as tmp:
            torch.save(model.state_dict(), tmp)
    return history


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPlan:
    """What `train megatron` builds, decided from the options and the HF config before anything is read."""

    vision: bool  # the family's HF vision tower embeds the images
    mrope: bool  # t/h/w rotary sections (Qwen2/2.5-VL)
    hf_config: Any
    text_reason: str  # why media would be refused on the text path

    def describe(self, num_layers: int) -> str:
        if self.vision:
            kind = "mRoPE" if self.mrope else "1-D rope"
            return f"GPT {num_layers} layers ({kind}) + the {self.hf_config.model_type} HF vision tower"
        return f"GPT {num_layers} layers, text only"


def plan_model(config: MegatronTrainConfig, hf_config: Any) -> ModelPlan:
    """Vision tower or text only (see the module docstring); refuses flags that contradict the HF width.

    Raises:
        TrainConfigError: ``--hidden-size`` / ``--num-attention-heads`` differ from the HF text config's
            while images are trained.
    """
    reason = "--ignore-media" if config.ignore_media else unsupported_reason(hf_config)
    if reason is not None:
        return ModelPlan(vision=False, mrope=False, hf_config=hf_config, text_reason=reason)
    text = hf_config.get_text_config()
    for flag, given, theirs in (
        ("--hidden-size", config.hidden_size, text.hidden_size),
        ("--num-attention-heads", config.num_attention_heads, text.num_attention_heads),
    ):
        if given is not None and given != theirs:
            raise TrainConfigError(
                f"{flag} {given}, but with images the language model takes the width of the HF text config "
                f"({theirs}): the {hf_config.model_type} projector writes vectors of that size. Leave {flag} out, "
                "or pass --ignore-media to train a text-only model of your size."
            )
    return ModelPlan(vision=True, mrope=vision_rope(hf_config) == "mrope", hf_config=hf_config, text_reason="")


def _build(
    config: MegatronTrainConfig, plan: ModelPlan, vocab_size: int, max_sequence_length: int, cp_rank: int
) -> tuple[torch.nn.Module, StepFn]:
    """The model on this GPU and the step function that feeds it (seeded: every rank builds the same)."""
    cp_size = config.context_parallel_size
    if plan.vision:
        gpt = vlm_gpt_config(
            plan.hf_config,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            num_layers=config.num_layers,
            mrope=plan.mrope,
            context_parallel_size=cp_size,
        )
    else:
        gpt = GPTConfig(
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size or TEXT_HIDDEN_SIZE,
            num_attention_heads=config.num_attention_heads or TEXT_ATTENTION_HEADS,
            context_parallel_size=cp_size,
        )
    language_model = build_gpt_model(gpt)
    if not plan.vision and cp_size == 1:
        return language_model, forward_step
    torch.manual_seed(config.seed)  # the HF vision tower initialises from the torch RNG
    vision = HFVisionEncoder(plan.hf_config).cuda(torch.cuda.current_device()) if plan.vision else None
    model = MegatronVLM(language_model, vision, mrope=plan.mrope)
    return model, partial(vlm_forward_step, context_parallel_size=cp_size, context_parallel_rank=cp_rank)


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


def text_only(
    batches: Iterable[PackedBatch], *, ignore_media: bool, reason: str = "no vision encoder on the Megatron side"
) -> Iterator[PackedBatch]:
    """``batches`` unchanged on the text-only path; a micro-batch with media raises unless ``ignore_media``.

    Raises:
        MediaInPackError: naming the packs, why this run has no vision tower, and the flag.
    """
    for batch in batches:
        if batch.num_media and not ignore_media:
            raise MediaInPackError(
                f"packs {', '.join(batch.pack_keys)} hold {batch.num_media} images/videos, but this `train megatron` "
                f"run trains the language model only ({reason}). Pass --ignore-media to train on their tokens as "
                "text, pack text-only data, or use `train hf` for the full VLM."
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
    step_fn: StepFn = forward_step,
    report: bool = True,
) -> StepMetrics:
    """One optimizer step: summed losses back-propagated, gradients / global label tokens.

    Args:
        step_fn: ``forward_step`` (a GPTModel) or `train.megatron.vlm.vlm_forward_step` bound to
            this context-parallel rank (a `MegatronVLM`); either returns this rank's token losses.
        report: Count this rank's micro-batches in the metrics' token and pack totals (False on
            context-parallel peers of the rank that does).
    """
    started = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    local_tokens = 0
    for batch in micro:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output, loss_fn = step_fn(iter([batch]), model)
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
        micro=micro if report else [],
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
