"""Run `train hf`'s own step on fixed micro-batches: one process, or ranks under torch.multiprocessing.

A `RunSpec` names a model directory, the sharding and the micro-batches of every step and rank
(``steps[s][r]`` = rank ``r``'s micro-batches of step ``s``). `run_alone` trains them in this
process with every rank's micro-batches in turn (the same global batch, no process group);
`run_ranks` spawns ``world_size`` gloo ranks that each train their own. Both return the step
losses, the global gradient norms and the final weights (whole, from rank 0).

The workers live here, not in a test file, so that spawned processes can import them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from train.batch import PackedBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    model_dir: Path
    steps: list[list[list[PackedBatch]]]  # [step][rank][micro-batch]
    sharding: str = "full"
    activation_checkpointing: bool = True
    cpu_offload: bool = False
    node_size: int | None = None  # LOCAL_WORLD_SIZE of each rank (hybrid); default: all ranks
    dtype: torch.dtype = torch.float64
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    lora_rank: int = 0  # LoRA adapters of this rank on every language-model linear (train.lora); 0: none

    @property
    def world_size(self) -> int:
        return len(self.steps[0])


@dataclasses.dataclass(frozen=True)
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    label_tokens: list[int]
    weights: dict[str, torch.Tensor]
    local_numel: int  # rank 0's trained parameter elements (its shards when sharded)
    local_state_numel: int  # rank 0's AdamW state elements (exp_avg + exp_avg_sq)
    shapes: list[tuple[int, ...]]  # every trained parameter's whole shape, each shared parameter once


def _train(spec: RunSpec, rank: int, sharding: str, micro_of_step: list[list[PackedBatch]]) -> RunResult | None:
    from train.distributed import init_distributed
    from train.lora import LoraSettings, apply_lora, init_adapters
    from train.recipes.hf import HFTrainConfig, _scheduler, _step
    from train.sharding import full_model_state, load_sharded_model, resolve_plan
    from train.vision_sync import VisionSync

    ctx = init_distributed("cpu")
    plan = resolve_plan(
        ctx,
        sharding=sharding,
        activation_checkpointing=spec.activation_checkpointing,
        cpu_offload=spec.cpu_offload and sharding != "none",
    )
    lora = LoraSettings(rank=spec.lora_rank) if spec.lora_rank else None
    model = load_sharded_model(
        spec.model_dir,
        seed=0,
        attn_implementation="packvlm_varlen",
        plan=plan,
        ctx=ctx,
        dtype=spec.dtype,
        prepare=None if lora is None else (lambda m: apply_lora(m, lora, seed=0)),  # as train hf: before sharding
    )
    if lora is not None:
        init_adapters(model, seed=0)
    model.train()
    config = HFTrainConfig(
        data=Path("-"),
        model=spec.model_dir,
        processor=Path("-"),
        output=Path("-"),
        max_steps=len(micro_of_step),
        lr=spec.lr,
        lr_schedule="constant",
        max_grad_norm=spec.max_grad_norm,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=spec.lr, weight_decay=0.0)  # a moved weight had a gradient
    scheduler = _scheduler(optimizer, config)
    vision_sync = VisionSync(model) if plan.sharded else None
    metrics = [
        _step(model, optimizer, scheduler, micro, config, ctx, step, plan=plan, vision_sync=vision_sync)
        for step, micro in enumerate(micro_of_step, start=1)
    ]
    weights = {k: v.clone() for k, v in full_model_state(model).items()}
    if rank != 0:
        return None
    return RunResult(
        [m.loss for m in metrics],
        [m.grad_norm for m in metrics],
        [m.num_label_tokens for m in metrics],
        weights,
        local_numel=sum(_local(p).numel() for p in trainable),
        shapes=[tuple(p.shape) for p in trainable],
        local_state_numel=sum(
            _local(v).numel() for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
        ),
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def run_alone(spec: RunSpec) -> RunResult:
    """Every rank's micro-batches of a step, in rank order, in this one process (sharding none)."""
    joined = [[b for rank_micro in step for b in rank_micro] for step in spec.steps]
    result = _train(spec, 0, "none", joined)
    assert result is not None
    return result


def _worker(rank: int, spec: RunSpec, port: int, out: str) -> None:
    world = spec.world_size
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(spec.node_size or world),
    )
    import torch.distributed as dist

    from train.distributed import shutdown

    # a collective one rank never joins fails the test in minutes instead of gloo's 30
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    try:
        result = _train(spec, rank, spec.sharding, [step[rank] for step in spec.steps])
        if result is not None:
            torch.save(result, out)
        dist.barrier()  # as `train hf` does: no rank tears gloo down while a peer still talks (CI saw a SIGABRT)
    finally:
        shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(spec: RunSpec) -> RunResult:
    """``spec.world_size`` gloo ranks on this machine, each training its own micro-batches."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(_worker, args=(spec, free_port(), out), nprocs=spec.world_size, start_method="spawn")
        return torch.load(out, weights_only=False)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    state: dict[str, torch.Tensor]  # the whole state dict, gathered on rank 0
    buffers: dict[str, torch.Tensor]
    bytes_read: list[int]  # per rank: bytes safetensors handed out (slices and whole tensors alike)


class _CountingSlice:
    def __init__(self, inner: object, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def __getitem__(self, index: object) -> torch.Tensor:
        tensor = self.inner[index]  # type: ignore[index]
        self.counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _CountingFile:
    """A ``safe_open`` handle counting every byte of tensor data it returns."""

    def __init__(self, inner: object, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def __enter__(self) -> _CountingFile:
        self.inner.__enter__()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> object:
        return self.inner.__exit__(*exc)  # type: ignore[attr-defined]

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(key), self.counter)  # type: ignore[attr-defined]

    def get_tensor(self, key: str) -> torch.Tensor:
        tensor = self.inner.get_tensor(key)  # type: ignore[attr-defined]
        self.counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _load_worker(rank: int, model_dir: Path, world: int, port: int, out: str) -> None:
    import safetensors

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import torch.distributed as dist

    from train.distributed import gather_objects, init_distributed, shutdown
    from train.sharding import full_model_state, load_sharded_model, resolve_plan

    counter = [0]
    opened = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _CountingFile(opened(*a, **k), counter)  # type: ignore[assignment]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    try:
        ctx = init_distributed("cpu")
        plan = resolve_plan(ctx, sharding="full", activation_checkpointing=False)
        model = load_sharded_model(model_dir, seed=0, attn_implementation="packvlm_varlen", plan=plan, ctx=ctx)
        read = gather_objects(counter[0], ctx)
        state = {k: v.clone() for k, v in full_model_state(model).items()}
        if rank == 0:
            buffers = {k: v.clone() for k, v in model.named_buffers()}
            torch.save(LoadResult(state, buffers, read), out)
        dist.barrier()  # as `train hf` does: no rank tears gloo down while a peer still talks
    finally:
        shutdown()


def load_ranks(model_dir: Path, world_size: int = 2) -> LoadResult:
    """`train.sharding.load_sharded_model` on ``world_size`` gloo ranks (``--sharding full``, fp32)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        args = (model_dir, world_size, free_port(), out)
        mp.start_processes(_load_worker, args=args, nprocs=world_size, start_method="spawn")
        return torch.load(out, weights_only=False)
