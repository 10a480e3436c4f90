"""`train hf`: a plain packed-THD training loop for Hugging Face models: config, command, loop.

One process per device (alone or under ``torchrun``). Each optimizer step takes
``grad_accum`` micro-batches per rank from the Energon loader (each micro-batch is
``packs_per_microbatch`` packs in one row, no padding), runs the model with varlen
attention, and normalises the summed token loss by the number of label tokens of the
**whole global batch** (every micro-batch on every rank), so a token weighs the same
whatever pack, micro-batch or rank it landed in. Several ranks shard the model with FSDP2
by default (`train.sharding`: ``--sharding full|hybrid``, gradients reduce-scattered as sums,
the vision tower kept in step on text-only micro-batches by `train.vision_sync`); with
``--sharding none`` every rank holds the whole model and gradients are summed with one
all-reduce per step (no DDP wrapper: the vision tower sees no input on text-only
micro-batches, which DDP's bucket hooks treat as an error). ``--activation-checkpointing``
(default on CUDA) recomputes every decoder layer and vision block in backward.

Exact resume: a checkpoint holds the weights (``save_pretrained``), optimizer, scheduler,
RNG, step and each rank's Energon loader state, so ``--resume`` continues with the very
micro-batches an uninterrupted run would have read. The run directory (claim, ``--resume``,
``train.log``) is `train.run_dir`'s, shared with `train megatron`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from tqdm import tqdm
from transformers import get_scheduler

from prep.cli_options import default_of
from schemas.train import LOG_FILE, METRICS_FILE
from train.attention import select_attention
from train.batch import PackedBatch
from train.checkpoint import (
    TrainerState,
    load_loader_state,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.chunked_loss import chunked_token_loss_sum
from train.distributed import DistContext, all_reduce_grads, barrier, init_distributed, shutdown
from train.loader import Sampling, loader_state, make_loader, rank_loader_config, validate_loader_config
from train.loss import global_label_tokens
from train.media import PixelWire
from train.metrics import MetricsWriter, StepMetrics, collect_step_metrics
from train.recipes.options import PATH, shared_options
from train.run_dir import attach_log_file, claim_run_dir, config_fingerprint, detach_log_file
from train.sharding import (
    SHARDINGS,
    ShardingPlan,
    clip_grad_norm,
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
    load_sharded_model,
    resolve_plan,
    sync_gradients_on,
)
from train.vision_sync import VisionSync

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class HFTrainConfig:
    """Every option of `train hf`; the click flags take their defaults from here."""

    data: Path
    model: Path
    processor: Path
    output: Path
    max_steps: int
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # any transformers.get_scheduler name
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    packs_per_microbatch: int = 1
    seed: int = 0
    save_every: int = 0  # 0: only at the end
    stop_after: int | None = None  # checkpoint and exit after this step; the schedule still spans max_steps
    resume: bool = False
    device: str = "auto"
    num_workers: int = 2
    sampling: Sampling = "epoch"  # every pack once per epoch; "buffer": Energon's streaming shuffle buffer
    pixels: PixelWire = "uint8"  # image pixels from the loader workers (train.pixels); "float32" as processed
    shuffle_buffer_size: int = 100  # with sampling "buffer"
    sharding: str = "auto"  # train.sharding.SHARDINGS; auto: full when world size > 1, else none
    activation_checkpointing: bool | None = None  # None: on for CUDA, off on CPU
    cpu_offload: bool = False  # FSDP shards, gradients and optimizer state in host memory

    def fingerprint(self) -> dict[str, Any]:
        """Options the trajectory depends on; a resumed run must match them."""
        # pixels: bit-equal inputs either way, so a run may resume with the other wire
        # sharding, checkpointing and offload change where numbers live and the order of sums, not the
        # trajectory (tests/train/test_sharding.py); the checkpoint's optimizer state is topology-free
        placement = ("sharding", "activation_checkpointing", "cpu_offload")
        return config_fingerprint(self, skip=("resume", "save_every", "max_steps", "stop_after", "pixels", *placement))


def _default(name: str) -> Any:
    """The default of an HFTrainConfig field: defaults live only in the config class."""
    return default_of(HFTrainConfig, name)


@click.command("hf")
@shared_options(HFTrainConfig)
@click.option(
    "--model",
    type=PATH,
    required=True,
    help="HF model directory; with weights they are loaded, config-only means random init with --seed.",
)
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
    "--sharding",
    type=click.Choice(SHARDINGS),
    default=_default("sharding"),
    show_default=True,
    help="FSDP2: full shards over all ranks, hybrid inside each node (replicated across nodes), none replicates; "
    "auto is full with several ranks, none with one.",
)
@click.option(
    "--activation-checkpointing/--no-activation-checkpointing",
    default=_default("activation_checkpointing"),
    help="Recompute each decoder layer and vision block in backward. [default: on for CUDA, off on CPU]",
)
@click.option(
    "--cpu-offload",
    is_flag=True,
    default=_default("cpu_offload"),
    help="Keep FSDP parameter shards, gradients and optimizer state in host memory (optimizer step on the CPU).",
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


def run(config: HFTrainConfig) -> list[StepMetrics]:
    """Train for ``config.max_steps`` optimizer steps; returns this process's step metrics."""
    ctx = init_distributed(config.device)
    try:
        history = _train(config, ctx)
        barrier(ctx)
        return history
    finally:
        shutdown()
        detach_log_file(config.output / LOG_FILE)


def _train(config: HFTrainConfig, ctx: DistContext) -> list[StepMetrics]:
    # the model's config gives the rope rule; weights are never read by the loader
    loader_config = rank_loader_config(config, model=str(config.model), rank=ctx.rank, world_size=ctx.world_size)
    info = validate_loader_config(loader_config)  # fail fast, before a model is built
    checkpoint = claim_run_dir(
        config.output, fingerprint=config.fingerprint(), command="train hf", resume=config.resume, ctx=ctx
    )
    if ctx.is_main:
        attach_log_file(config.output / LOG_FILE)
    attention = select_attention(ctx.device)
    plan = resolve_plan(
        ctx,
        sharding=config.sharding,
        activation_checkpointing=config.activation_checkpointing,
        cpu_offload=config.cpu_offload,
    )
    model = load_sharded_model(
        checkpoint or config.model, seed=config.seed, attn_implementation=attention, plan=plan, ctx=ctx
    )
    model.train()
    vision_sync = VisionSync(model) if plan.sharded else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    start = 0
    restored_loader = None
    if checkpoint is not None:
        state = load_trainer_state(checkpoint)
        load_full_optimizer_state(model, optimizer, state.optimizer)
        set_rng_state(state.rng)
        restored_loader = load_loader_state(checkpoint, ctx)
        start = state.step
        log.info("resumed from %s at step %d", checkpoint, start)
    scheduler = _scheduler(optimizer, config, start)
    loader = make_loader(loader_config, state=restored_loader, validate=False)
    writer = MetricsWriter(config.output / METRICS_FILE)
    if ctx.is_main:
        writer.truncate_after(start)
    log.info(
        "train hf: %s (%d packs of %d tokens, %s) on %s x%d, attention %s, %s, steps %d..%d",
        config.data,
        info.num_packs,
        info.pack_size,
        info.processor_class,
        ctx.device,
        ctx.world_size,
        attention,
        plan,
        start,
        config.max_steps,
    )
    batches = iter(loader)
    history = []
    progress = tqdm(total=config.max_steps, initial=start, disable=not ctx.is_main, desc="train", unit="step")
    last = min(config.max_steps, config.stop_after or config.max_steps)
    for step in range(start + 1, last + 1):
        micro = [next(batches) for _ in range(config.grad_accum)]
        metrics = _step(model, optimizer, scheduler, micro, config, ctx, step, plan=plan, vision_sync=vision_sync)
        history.append(metrics)
        progress.update(1)
        if ctx.is_main:
            writer.write(metrics)
            progress.set_postfix(loss=f"{metrics.loss:.4f}", tok_s=f"{metrics.tokens_per_s:,.0f}")
            log.info(metrics.log_line(config.max_steps))
        if step == last or (config.save_every and step % config.save_every == 0):
            state = TrainerState(step=step, optimizer=full_optimizer_state(model, optimizer), rng=rng_state())
            path = save_checkpoint(
                config.output,
                ctx,
                model=model,
                model_state=full_model_state(model),
                processor_dir=config.processor,
                state=state,
                loader_state=loader_state(loader),
            )
            log.info("checkpoint %s", path)
    progress.close()
    return history


def _scheduler(optimizer: torch.optim.Optimizer, config: HFTrainConfig, step: int) -> Any:
    """The LR schedule over ``max_steps``, advanced to ``step``.

    Rebuilt rather than restored: the learning rate of every step is then a function of the
    step and today's options alone, so a resumed run (even one given a longer --max-steps)
    never applies a rate left in the optimizer by the previous schedule.
    """
    scheduler = get_scheduler(
        config.lr_schedule, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=config.max_steps
    )
    with warnings.catch_warnings():  # stepping the schedule before optimizer.step() is intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()
    return scheduler


def _step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    micro: list[PackedBatch],
    config: HFTrainConfig,
    ctx: DistContext,
    step: int,
    *,
    plan: ShardingPlan,
    vision_sync: VisionSync | None = None,
) -> StepMetrics:
    """One optimizer step over this rank's micro-batches; loss normalised by global label tokens.

    Sharded (``plan.sharded``), FSDP2 sums the gradients over ranks in backward and
    ``vision_sync`` gives every rank the same vision-tower calls; otherwise one all-reduce sums them.
    """
    started = time.perf_counter()
    num_label_tokens = global_label_tokens(micro)  # the normaliser: every label token of the global batch
    extra_calls = vision_sync.agree(micro, ctx) if vision_sync is not None else [0] * len(micro)
    loss_sum = 0.0
    for index, batch in enumerate(micro):
        batch = batch.to(ctx.device)
        sync_gradients_on(model, index, len(micro))
        padded = vision_sync.padded(extra_calls[index]) if vision_sync is not None else contextlib.nullcontext()
        with _autocast(ctx.device), padded:  # the head runs under autocast too, as it would inside the forward
            summed, _ = chunked_token_loss_sum(model, batch)  # logits only at label positions, in chunks
        (summed / max(num_label_tokens, 1.0)).backward()
        loss_sum += float(summed.detach())
    if not plan.sharded:
        all_reduce_grads(model, ctx)
    grad_norm = clip_grad_norm(model, config.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return collect_step_metrics(
        step=step,
        micro=micro,
        ctx=ctx,
        loss_sum=loss_sum,
        num_label_tokens=num_label_tokens,
        lr=lr,
        grad_norm=grad_norm,
        started=started,
    )


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); exact fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
