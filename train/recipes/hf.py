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

Exact resume: a checkpoint (`train.checkpoint`, torch.distributed.checkpoint) holds the
model and optimizer shards, each rank's RNG, the step and the global data position, so
``--resume`` continues with the very micro-batches an uninterrupted run would have read; on
another number of ranks it continues the same epoch order, every pack once (elastic resume,
`train.global_order`). A run that reaches ``--max-steps`` exports its last checkpoint to
``OUT/final`` (`train.export`). The run directory (claim, ``--resume``, ``train.log``) is
`train.run_dir`'s, shared with `train megatron`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from tqdm import tqdm
from transformers import get_scheduler

from packvlm.cli import default_of
from packvlm.errors import UsageError
from packvlm.faults import crash_point
from schemas.train import FINAL_DIR, LOG_FILE, METRICS_FILE
from train.attention import select_attention
from train.batch import PackedBatch
from train.checkpoint import TrainerState, load_checkpoint, load_loader_state, save_checkpoint
from train.chunked_loss import chunked_token_loss_sum
from train.dataset import PackedDatasetInfo
from train.distributed import (
    DistContext,
    RankLostError,
    all_reduce_grads,
    barrier,
    init_distributed,
    lost_peer,
    shutdown,
)
from train.evaluate import Evaluator, eval_loader_config, validate_eval_config
from train.export import export_checkpoint
from train.loader import (
    LoaderConfig,
    Sampling,
    global_position,
    loader_state,
    make_loader,
    rank_loader_config,
    validate_loader_config,
)
from train.lora import LoraExport, LoraSettings, apply_lora, init_adapters, save_adapter
from train.loss import global_label_tokens
from train.media import PixelWire
from train.metrics import MetricsWriter, StepMetrics, collect_step_metrics
from train.plan import render
from train.recipes.options import PATH, shared_options
from train.recipes.plan_options import plan_options, plan_run, pop_plan_request
from train.recipes.trainable_options import trainable_options
from train.report import REPORTERS, eval_scalars, open_reporters, step_scalars
from train.run_dir import attach_log_file, claim_run_dir, config_fingerprint, detach_log_file, released_on_failure
from train.sharding import (
    SHARDINGS,
    ShardingPlan,
    clip_grad_norm,
    load_sharded_model,
    resolve_plan,
    sync_gradients_on,
)
from train.trainable import Group, freeze, num_trainable, trainable_parameters
from train.vision_sync import VisionSync

log = logging.getLogger(__name__)


# options a resumed run may change: pixels gives bit-equal inputs either way; grad_accum lets a run resumed
# on another number of ranks keep its global batch (a change is logged)
RESUME_MAY_CHANGE = (
    "resume",
    "resume_if_exists",
    "save_every",
    "keep_last",
    "max_steps",
    "stop_after",
    "pixels",
    "final_export",
    "final_checkpoint",
    "grad_accum",
    "dist_timeout_s",
    "lora_export",
    "eval_every",  # evaluation restores the RNG, so it changes no step
    "report_to",
    # sharding, checkpointing and offload change where numbers live and the order of sums, not the
    # trajectory (tests/train/test_sharding.py); DCP checkpoints reshard to any placement
    "sharding",
    "activation_checkpointing",
    "cpu_offload",
)


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
    packs_per_microbatch: int = default_of(LoaderConfig, "packs_per_microbatch")
    seed: int = default_of(LoaderConfig, "seed")
    save_every: int = 0  # 0: only at the end
    keep_last: int = 0  # keep only the newest N checkpoints; 0: all
    stop_after: int | None = None  # checkpoint and exit after this step; the schedule still spans max_steps
    resume: bool = False
    resume_if_exists: bool = False  # resume when OUT holds a checkpoint, else start fresh
    final_export: bool = True  # export the last checkpoint to OUT/final when the run reaches max_steps
    # False: no checkpoint at max_steps (so no OUT/final either): a benchmark or smoke run that measures
    # steps only (a 3.75B model's checkpoint is ~60 GB of fp32 weights + AdamW); --stop-after still saves
    final_checkpoint: bool = True
    device: str = "auto"
    # the loader's options: their defaults are LoaderConfig's (train.loader)
    num_workers: int = default_of(LoaderConfig, "num_workers")
    sampling: Sampling = default_of(LoaderConfig, "sampling")
    pixels: PixelWire = default_of(LoaderConfig, "pixels")
    shuffle_buffer_size: int = default_of(LoaderConfig, "shuffle_buffer_size")
    # a collective waiting longer than this for another rank fails, so the living ranks exit when one
    # dies instead of hanging (a checkpoint save on rank 0 is waited for at a barrier: keep it long)
    dist_timeout_s: int = 1800
    freeze: tuple[Group, ...] = ()  # train.trainable groups kept as loaded
    lora_rank: int = 0  # 0: train the (unfrozen) weights; R: only LoRA adapters of rank R (train.lora)
    lora_alpha: float | None = None  # None: 2 x lora_rank
    lora_targets: tuple[str, ...] = ()  # leaf names inside the language model; empty: all its decoder linears
    lora_export: LoraExport = "adapter"  # "merged": the end of the run also writes OUT/merged
    eval_every: int = 0  # validation loss every N steps and after the last (train.evaluate); 0: never
    report_to: tuple[str, ...] = ()  # "tensorboard", "wandb" (train.report); metrics.jsonl is always written
    sharding: str = "auto"  # train.sharding.SHARDINGS; auto: full when world size > 1, else none
    activation_checkpointing: bool | None = None  # None: on for CUDA, off on CPU
    cpu_offload: bool = False  # FSDP shards, gradients and optimizer state in host memory

    def __post_init__(self) -> None:
        if not self.final_checkpoint and self.lora_rank and self.lora_export == "merged":
            raise UsageError("--lora-export merged is written from the final checkpoint; drop --no-final-checkpoint")
        if self.lora_rank and self.freeze:
            raise UsageError("--freeze has no effect with --lora-rank (only the adapters train); drop --freeze")
        if {"vision", "projector", "language"} <= set(self.freeze):  # checked before the run directory is claimed
            raise UsageError(f"--freeze {' --freeze '.join(self.freeze)} leaves nothing to train")

    def lora(self) -> LoraSettings | None:
        """The LoRA adapters to add, or None (full fine-tuning of the unfrozen groups)."""
        if not self.lora_rank:
            return None
        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets)

    def fingerprint(self) -> dict[str, Any]:
        """Options the trajectory depends on; a resumed run must match them."""
        return config_fingerprint(self, skip=RESUME_MAY_CHANGE)


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
    "--keep-last",
    type=click.IntRange(min=0),
    default=_default("keep_last"),
    show_default=True,
    help="Keep only the newest N checkpoints (older ones deleted once a new one is complete); 0: keep all.",
)
@click.option(
    "--stop-after",
    type=click.IntRange(min=1),
    default=_default("stop_after"),
    help="Checkpoint and exit after this step (e.g. a job's time slot); --resume continues the same schedule.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from OUT's latest checkpoint, exactly; on any number of ranks with --sampling epoch.",
)
@click.option(
    "--resume-if-exists",
    is_flag=True,
    help="Resume when OUT holds a checkpoint, else start fresh (a job script rerun as it is).",
)
@click.option(
    "--final-export/--no-final-export",
    default=_default("final_export"),
    show_default=True,
    help="When the run reaches --max-steps, write OUT/final: save_pretrained + processor files (`train export`).",
)
@click.option(
    "--final-checkpoint/--no-final-checkpoint",
    default=_default("final_checkpoint"),
    show_default=True,
    help="Checkpoint at --max-steps (off: no checkpoint and no OUT/final at the end, e.g. for a benchmark run; "
    "--save-every and --stop-after checkpoints are still written).",
)
@click.option(
    "--eval-every",
    type=click.IntRange(min=0),
    default=_default("eval_every"),
    show_default=True,
    help="Token-weighted loss on the 'val' split (every pack once across ranks) every N steps and after the "
    "last; written to OUT/eval.jsonl and logged (0: never).",
)
@click.option(
    "--report-to",
    type=click.Choice(REPORTERS),
    multiple=True,
    default=_default("report_to"),
    help="Also send step metrics, eval loss, LR and memory to tensorboard (OUT/tensorboard) or wandb "
    "(WANDB_MODE=offline works without network). Repeatable.",
)
@click.option("--device", default=_default("device"), show_default=True, help="auto, cpu or cuda.")
@click.option(
    "--dist-timeout-s",
    type=click.IntRange(min=1),
    default=_default("dist_timeout_s"),
    show_default=True,
    help="Seconds a collective waits for the other ranks before failing (a dead rank ends the run, never hangs it).",
)
@trainable_options(HFTrainConfig)
@plan_options
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
    train hf --data ./example-out/packed-images --model ./example-data/model \\
        --processor ./example-data/processor --output ./example-out/run --max-steps 30
    torchrun --nproc_per_node 2 -m train.cli hf ...   # one process per device
    train hf ... --plan --plan-world-size 8 --gpu-memory 80GB   # memory per GPU, then exit
    """
    options["report_to"] = tuple(options["report_to"])
    plan = pop_plan_request(options)
    config = HFTrainConfig(**options)
    if plan is not None:
        click.echo(render(plan_run(config, plan)))
        return
    history = run(config)
    if history and int(os.environ.get("RANK", "0")) == 0:
        last = history[-1]
        click.echo(
            f"trained steps {history[0].step}..{last.step}: loss {history[0].loss:.4f} -> {last.loss:.4f}, "
            f"{sum(m.num_real_tokens for m in history):,} tokens, last {last.tokens_per_s:,.0f} tokens/s, "
            f"real-token fraction {100 * last.real_token_fraction:.2f}%; metrics and checkpoints in {options['output']}"
        )


def run(config: HFTrainConfig) -> list[StepMetrics]:
    """Train for ``config.max_steps`` optimizer steps; returns this process's step metrics."""
    ctx = init_distributed(config.device, timeout_s=config.dist_timeout_s)
    try:
        history = _train(config, ctx)
        barrier(ctx)
        return history
    except Exception as exc:
        if ctx.is_distributed and lost_peer(exc):
            raise RankLostError(
                f"rank {ctx.rank}: another rank stopped answering within --dist-timeout-s {config.dist_timeout_s} "
                f"({exc}); rerun the same command with --resume to continue from the last checkpoint"
            ) from exc
        raise
    finally:
        shutdown()
        detach_log_file(config.output / LOG_FILE)


def _train(config: HFTrainConfig, ctx: DistContext) -> list[StepMetrics]:
    # the model's config gives the rope rule; weights are never read by the loader
    loader_config = rank_loader_config(config, model=str(config.model), rank=ctx.rank, world_size=ctx.world_size)
    info = validate_loader_config(loader_config)  # fail fast, before a model is built
    eval_config = eval_loader_config(loader_config) if config.eval_every else None
    if eval_config is not None:
        validate_eval_config(eval_config)
    created = not config.output.exists()
    checkpoint = claim_run_dir(
        config.output,
        fingerprint=config.fingerprint(),
        command="train hf",
        resume=config.resume,
        resume_if_exists=config.resume_if_exists,
        ctx=ctx,
    )
    if ctx.is_main:
        attach_log_file(config.output / LOG_FILE)
    with released_on_failure(config.output, ctx, created=created):
        return _fit(config, ctx, loader_config, info, checkpoint, eval_config)


def _fit(
    config: HFTrainConfig,
    ctx: DistContext,
    loader_config: LoaderConfig,
    info: PackedDatasetInfo,
    checkpoint: Path | None,
    eval_config: LoaderConfig | None,
) -> list[StepMetrics]:
    attention = select_attention(ctx.device)
    plan = resolve_plan(
        ctx,
        sharding=config.sharding,
        activation_checkpointing=config.activation_checkpointing,
        cpu_offload=config.cpu_offload,
    )
    lora = config.lora()
    wrapped: dict[int, Any] = {}  # id(model) -> its peft wrapper (rank 0 may prepare a second, source copy)

    def prepare(m: torch.nn.Module) -> None:  # before fully_shard, on every copy of the model
        if config.freeze:
            freeze(m, config.freeze)
        if lora is not None:
            wrapped[id(m)] = apply_lora(m, lora, seed=config.seed)

    model = load_sharded_model(  # a checkpoint's weights (and LoRA adapters) are loaded below, after sharding
        config.model,
        seed=config.seed,
        attn_implementation=attention,
        plan=plan,
        ctx=ctx,
        prepare=prepare if config.freeze or lora is not None else None,
    )
    model.train()
    vision_sync = VisionSync(model) if plan.sharded else None
    saved = wrapped.get(id(model), model)  # what a LoRA checkpoint also writes as a peft adapter: the peft wrapper
    if lora is not None:
        init_adapters(model, config.seed)  # drawn on the materialised shards, whichever way they were loaded
    if not num_trainable(model):
        raise UsageError(f"--freeze {' --freeze '.join(config.freeze)} leaves nothing to train")
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=config.lr, weight_decay=config.weight_decay)
    # built before a checkpoint loads: the template DCP fills holds each group's initial_lr, and the
    # schedule is then advanced to the step from the options alone (see _scheduler)
    scheduler = _scheduler(optimizer, config)
    start = 0
    restored_loader = None
    global_batch_packs = ctx.world_size * config.grad_accum * config.packs_per_microbatch
    if checkpoint is not None:
        resumed = load_checkpoint(checkpoint, ctx, model=model, optimizer=optimizer)
        restored_loader = load_loader_state(checkpoint, resumed, ctx)
        start = resumed.step
        log.info("resumed from %s at step %d (saved on %d ranks)", checkpoint, start, resumed.world_size)
        if resumed.global_batch_packs != global_batch_packs:
            log.warning(
                "global batch changes from %d to %d packs per step (ranks x --grad-accum x --packs-per-microbatch); "
                "set --grad-accum to keep it",
                resumed.global_batch_packs,
                global_batch_packs,
            )
    _advance(scheduler, start)
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
    batches: Iterator[PackedBatch] = iter(loader)
    evaluator = None
    if eval_config is not None:
        evaluator = Evaluator(eval_config, config.eval_every, config.output, ctx, resumed_at=start)
    reporter = open_reporters(config.report_to, config.output, config.fingerprint(), ctx.is_main, resumed=start > 0)
    history = []
    # a bar only on a terminal (disable=None): logs and CI output get the step lines alone
    progress = tqdm(
        total=config.max_steps, initial=start, disable=None if ctx.is_main else True, desc="train", unit="step"
    )
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
        reported = step_scalars(metrics, ctx.device) if reporter.active else {}
        if evaluator is not None and evaluator.due(step, last):
            result = evaluator.run(model, step, _autocast)
            reported |= eval_scalars(result)
            if ctx.is_main:
                log.info("%s (train loss %.4f)", result.log_line(config.max_steps), metrics.loss)
        reporter.log(step, reported)
        final = step == last and (config.final_checkpoint or last < config.max_steps)
        if final or (config.save_every and step % config.save_every == 0):
            position = global_position(loader)
            state = TrainerState(
                step=step, world_size=ctx.world_size, global_batch_packs=global_batch_packs, data=position
            )
            path = save_checkpoint(
                config.output,
                ctx,
                model=model,
                optimizer=optimizer,
                processor_dir=config.processor,
                state=state,
                loader_state=None if position is not None else loader_state(loader),
                keep_last=config.keep_last,
            )
            if lora is not None:
                save_adapter(saved, path, ctx)  # a peft adapter directory beside the shards
            log.info("checkpoint %s", path)
            if step == config.max_steps and config.final_export and lora is None and ctx.is_main:
                log.info("exported %s", export_checkpoint(path, config.output / FINAL_DIR, replace=True))
    progress.close()
    if lora is not None and config.lora_export == "merged" and last == config.max_steps and ctx.is_main:
        # from the last checkpoint's shards in this one process: the base weights are never gathered on the ranks
        merged = export_checkpoint(path, config.output / "merged", replace=True)
        log.info("merged model %s", merged)
    reporter.close()
    return history


def _scheduler(optimizer: torch.optim.Optimizer, config: HFTrainConfig) -> Any:
    """The LR schedule over ``max_steps``, at step 0.

    Rebuilt rather than restored: the learning rate of every step is then a function of the
    step and today's options alone, so a resumed run (even one given a longer --max-steps)
    never applies a rate left in the optimizer by the previous schedule.
    """
    return get_scheduler(
        config.lr_schedule, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=config.max_steps
    )


def _advance(scheduler: Any, step: int) -> None:
    """Move the schedule to ``step`` (a resumed run), setting the optimizer's rates from the schedule."""
    with warnings.catch_warnings():  # stepping the schedule before optimizer.step() is intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()


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
    crash_point(f"train.before_grad_all_reduce.rank{ctx.rank}")  # tests kill one rank here, the others wait
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
