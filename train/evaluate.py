"""Validation loss: the token-weighted loss over every pack of the validation split, once.

``prep energon-index`` writes a ``val`` split (``--split-ratio 0.9,0.1,0``); `train hf
--eval-every N` reads it here every ``N`` optimizer steps and after the last one. Each rank
takes its share from Energon's validation loader (``get_val_dataset``: no shuffle, no repeat,
the split's packs cut into one contiguous range per global worker, ranks x loader workers), so
across ranks every pack is read exactly once. Like the training loss, the number is a ratio of
sums, never a mean of per-batch means::

    eval_loss = sum over ranks, micro-batches, label tokens of CE  /  label tokens of the split

Ranks may hold a different number of micro-batches (worker ranges differ by one pack). With a
process group every rank runs the same number of forward passes: a rank that has run out
repeats its first micro-batch and discards the result, so a sharded model (FSDP gathers
parameters inside the forward) never waits on a rank that has stopped.

Example: val packs A (300 label tokens, summed CE 600.0) and B (100, 500.0) on two ranks:
rank 0 reads A, rank 1 reads B; eval_loss = (600 + 500) / 400 = 2.75 (a mean of the two
per-pack means would say 3.5).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.energon import WorkerConfig, get_loader, get_val_dataset
from megatron.energon.errors import reraise_exception

from packvlm.energon import quiet_pin_memory_without_accelerator
from train.batch import PackedBatch
from train.chunked_loss import chunked_token_loss_sum
from train.dataset import PackedDatasetInfo, TrainConfigError
from train.distributed import DistContext, gather_objects
from train.encoder import PackedBatchTaskEncoder
from train.loader import LoaderConfig, validate_loader_config
from train.metrics import MetricsWriter

EVAL_FILE = "eval.jsonl"
EVAL_SPLIT = "val"


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalResult:
    """One evaluation over the whole validation split, all ranks."""

    step: int
    loss: float  # summed CE / num_label_tokens over every validation pack
    num_label_tokens: int
    num_packs: int
    seconds: float

    def log_line(self, max_steps: int) -> str:
        return (
            f"step {self.step}/{max_steps} eval_loss {self.loss:.4f} label_tokens {self.num_label_tokens} "
            f"packs {self.num_packs} ({self.seconds:.1f} s)"
        )


def eval_loader_config(train_config: LoaderConfig) -> LoaderConfig:
    """The validation split read once per evaluation, with the training run's ranks and workers."""
    return replace(train_config, split=EVAL_SPLIT, repeat=False)


def validate_eval_config(config: LoaderConfig) -> PackedDatasetInfo:
    """The validation split exists and gives every rank at least one pack; else what to run."""
    try:
        return validate_loader_config(replace(config, num_workers=0))  # a worker may go without a pack
    except TrainConfigError as exc:
        raise TrainConfigError(
            f"--eval-every needs a {EVAL_SPLIT!r} split with a pack per rank: {exc}; index with e.g. "
            f"`prep energon-index {config.data} --split-ratio 0.9,0.1,0`"
        ) from exc


def make_eval_loader(config: LoaderConfig) -> Any:
    """Energon's validation loader of this rank over ``config.split`` (`PackedBatch` micro-batches).

    Iterating it again starts the split again: one loader serves every evaluation.
    """
    worker_config = WorkerConfig(
        rank=config.rank,
        world_size=config.world_size,
        num_workers=config.num_workers,
        seed_offset=config.seed,
        global_error_handler=reraise_exception,
    )
    dataset = get_val_dataset(
        config.data,
        split_part=config.split,
        worker_config=worker_config,
        batch_size=config.packs_per_microbatch,
        task_encoder=PackedBatchTaskEncoder(config.processor, config.model, config.pixels),
    )
    quiet_pin_memory_without_accelerator()
    return get_loader(dataset)


def _lockstep(batches: Iterable[PackedBatch], ctx: DistContext) -> Iterator[tuple[PackedBatch, bool]]:
    """(batch, counts) pairs until every rank has run out; a rank past its end repeats its first batch.

    One small all-reduce per micro-batch tells each rank whether any rank still has data.
    """
    first: PackedBatch | None = None
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        if ctx.is_distributed:
            device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
            more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not int(more.item()):
                return
        elif batch is None:
            return
        if batch is not None:
            first = batch if first is None else first
            yield batch, True
        elif first is not None:
            yield first, False
        else:
            raise TrainConfigError(f"rank {ctx.rank} got no {EVAL_SPLIT!r} pack: use fewer ranks or more val packs")


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[PackedBatch],
    ctx: DistContext,
    *,
    step: int,
    precision: Callable[[torch.device], AbstractContextManager[Any]] = lambda device: nullcontext(),
) -> EvalResult:
    """Token-weighted loss of ``model`` over this rank's ``batches``, summed over every rank.

    Runs without gradients, in eval mode (the model's training mode is restored). Every rank
    must call it (collectives inside).

    Args:
        precision: The training step's compute context for a device (its bf16 autocast on CUDA),
            so the validation loss is computed as the training loss is.
    """
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    loss_sum, tokens, packs = 0.0, 0, 0
    try:
        with torch.no_grad():
            for batch, counts in _lockstep(batches, ctx):
                batch = batch.to(ctx.device)
                with precision(ctx.device):
                    summed, count = chunked_token_loss_sum(model, batch, backend="chunked")
                if counts:
                    loss_sum += float(summed)
                    tokens += count
                    packs += len(batch.pack_keys)
    finally:
        model.train(was_training)
    totals = [0.0, 0, 0]
    for rank_sum, rank_tokens, rank_packs in gather_objects((loss_sum, tokens, packs), ctx):
        totals = [totals[0] + rank_sum, totals[1] + rank_tokens, totals[2] + rank_packs]
    return EvalResult(
        step=step,
        loss=totals[0] / max(int(totals[1]), 1),
        num_label_tokens=int(totals[1]),
        num_packs=int(totals[2]),
        seconds=time.perf_counter() - started,
    )


class EvalWriter(MetricsWriter):
    """``eval.jsonl``: one `EvalResult` line per evaluation (rewound on resume like metrics.jsonl)."""

    def write(self, result: EvalResult) -> None:  # type: ignore[override]
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(result), sort_keys=True) + "\n")


def read_eval(path: Path) -> list[dict[str, Any]]:
    """All lines of an eval file, in step order."""
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]


class Evaluator:
    """What `train hf --eval-every N` does: evaluate every ``N`` steps and after the last, log, write.

    Evaluation leaves the training trajectory alone: the RNG states are restored afterwards, so
    a run with ``--eval-every`` takes the very steps of one without.
    """

    def __init__(self, config: LoaderConfig, every: int, output: Path, ctx: DistContext, *, resumed_at: int) -> None:
        self.every = every
        self.ctx = ctx
        self.loader = make_eval_loader(config)
        self.writer = EvalWriter(output / EVAL_FILE)
        if ctx.is_main:
            self.writer.truncate_after(resumed_at)

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def run(
        self,
        model: torch.nn.Module,
        step: int,
        precision: Callable[[torch.device], AbstractContextManager[Any]],
    ) -> EvalResult:
        from train.checkpoint import rng_state, set_rng_state

        saved = rng_state()
        try:
            result = evaluate(model, self.loader, self.ctx, step=step, precision=precision)
        finally:
            set_rng_state(saved)
        if self.ctx.is_main:
            self.writer.write(result)
        return result
