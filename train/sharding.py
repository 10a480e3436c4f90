"""FSDP2 for `train hf`: which modules are sharded, on which mesh, in which precision, loaded how.

``--sharding full`` shards parameters, gradients and optimizer state over every rank;
``hybrid`` shards inside a node and replicates across nodes (a 2-D mesh ``(nodes, ranks per
node)``, the node size from ``LOCAL_WORLD_SIZE``); ``none`` keeps a full copy per rank and
all-reduces gradients (`train.distributed.all_reduce_grads`). The units of FSDP2's
``fully_shard`` are the modules transformers checkpoints (`layer_modules`: every decoder
layer and vision block) plus the root, which holds the rest (embeddings, head, patch embedding,
projector)::

    model                  root group: embed_tokens, lm_head, norms, patch_embed, merger
      visual.blocks.i      one group each (all-gathered in forward, reduce-scattered in backward)
      language_model.layers.i

Exactness: every rank's loss is its *summed* token loss over the global label-token count,
so the gradient is the sum over ranks, not their mean. FSDP2 divides by the data-parallel
size by default; here the divide factor is 1 and the collectives are plain sums
(``set_force_sum_reduction_for_comms``), so the reduced gradient equals the one-process one
up to fp32 summation order. ``clip_grad_norm_`` over DTensor gradients reduces the norm over
the mesh: the global norm.

Precision: on CUDA the compute copy is bf16 and gradients are reduced in fp32 over fp32
master shards (``MixedPrecisionPolicy``); on CPU everything is fp32, exact.

Loading (`load_sharded_model`): with safetensors weights, each rank builds the model on the meta
device, shards it and reads only its own slices of the files (`train.shard_loading`: DCP's
``HuggingFaceStorageReader`` behind transformers' key renames): no rank ever holds the whole
model. Otherwise (``pytorch_model*.bin``, a checkpoint whose keys need more than a rename, or a
config-only directory initialised from ``--seed`` exactly as one process would) rank 0 alone
builds the whole model on the host, every other rank on the meta device; each rank shards its
empty model and ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends one tensor at a
time, each rank keeping its slice: one model copy in the whole job (rank 0's) plus one tensor
in flight.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer

from packvlm.errors import UsageError
from train.distributed import DistContext
from train.models import build_model, has_weights, load_model
from train.shard_loading import (
    checkpoint_key_map,
    checkpoint_keys,
    compute_buffers,
    load_own_shards,
    restore_buffers,
    safetensors_files,
    uncovered,
)

log = logging.getLogger(__name__)

Sharding = Literal["full", "hybrid", "none"]
SHARDINGS: tuple[str, ...] = ("auto", "full", "hybrid", "none")


class ShardingError(UsageError):
    """The sharding options do not fit this launch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingPlan:
    """How the model is spread over the ranks (options resolved against the launch)."""

    sharding: Sharding
    activation_checkpointing: bool
    cpu_offload: bool
    node_size: int  # ranks per node: the shard group of "hybrid"
    mixed_precision: bool  # bf16 compute copy, fp32 reduction (CUDA)

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"


def resolve_plan(
    ctx: DistContext,
    *,
    sharding: str = "auto",
    activation_checkpointing: bool | None = None,
    cpu_offload: bool = False,
) -> ShardingPlan:
    """``auto`` -> ``full`` when there are several ranks, else ``none``; checkpointing on for CUDA by default."""
    if sharding not in SHARDINGS:
        raise ShardingError(f"--sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")
    resolved = ("full" if ctx.world_size > 1 else "none") if sharding == "auto" else sharding
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world_size)))
    if resolved == "hybrid" and (node_size < 1 or ctx.world_size % node_size):
        raise ShardingError(
            f"--sharding hybrid needs whole nodes: {ctx.world_size} ranks, {node_size} per node (LOCAL_WORLD_SIZE)"
        )
    if cpu_offload and resolved == "none":
        raise ShardingError("--cpu-offload offloads FSDP shards: use it with --sharding full or hybrid")
    on_cuda = ctx.device.type == "cuda"
    return ShardingPlan(
        sharding=resolved,  # type: ignore[arg-type]  # checked against SHARDINGS above
        activation_checkpointing=on_cuda if activation_checkpointing is None else activation_checkpointing,
        cpu_offload=cpu_offload,
        node_size=node_size,
        mixed_precision=on_cuda,
    )


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer and vision block, in module order: the modules transformers checkpoints.

    They are the outermost ``GradientCheckpointingLayer`` instances (a layer inside another is
    part of its parent's unit).
    """
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, GradientCheckpointingLayer):
            continue
        layers.append(module)
        inside.update(id(sub) for sub in module.modules())
    return layers


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every layer and vision block in backward (non-reentrant: keyword arguments kept).

    transformers' ``GradientCheckpointingLayer`` binds the call's keywords (``cu_seq_lens_q``, the
    image-block rule, the gated-delta-net boundaries) into the recomputed call, so a recomputed
    layer sees exactly what its forward saw. It checkpoints ``forward``, not ``__call__``: FSDP2's
    hooks on the layer stay outside the recomputed region (all-gather once per backward).
    """
    if not layer_modules(model):
        raise ShardingError(f"{type(model).__name__} has no checkpointable layers; pass --no-activation-checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:  # older: the same layers; they checkpoint `__call__`, which FSDP2 also composes with
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def ensure_process_group(ctx: DistContext) -> None:
    """FSDP needs a process group even for one process (``--sharding full`` on one GPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def device_mesh(plan: ShardingPlan, ctx: DistContext) -> DeviceMesh:
    """1-D ``(shard,)`` for full; 2-D ``(replicate, shard)`` for hybrid, one shard group per node."""
    ensure_process_group(ctx)
    if plan.sharding == "hybrid":
        shape = (ctx.world_size // plan.node_size, plan.node_size)
        return init_device_mesh(ctx.device.type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))


def shard_model(model: nn.Module, plan: ShardingPlan, ctx: DistContext) -> nn.Module:
    """``fully_shard`` every layer and vision block, then the root; gradients summed, not averaged."""
    if plan.activation_checkpointing:
        enable_activation_checkpointing(model)
    if not plan.sharded:
        return model
    mesh = device_mesh(plan, ctx)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mixed if plan.mixed_precision else MixedPrecisionPolicy(),
        # pinned host memory exists only beside CUDA (mixed_precision is "on CUDA")
        "offload_policy": CPUOffloadPolicy(pin_memory=plan.mixed_precision) if plan.cpu_offload else OffloadPolicy(),
    }
    for layer in layer_modules(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for module in model.modules():  # both setters act on one module's groups only, not its children's
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is already over the global label tokens
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    log.info("FSDP2 %s over mesh %s: %d layer groups + root", plan.sharding, mesh, len(layer_modules(model)))
    return model


def load_sharded_model(
    model_dir: str | Path,
    *,
    seed: int,
    attn_implementation: str,
    plan: ShardingPlan,
    ctx: DistContext,
    dtype: torch.dtype = torch.float32,
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """The model sharded per ``plan``, master weights in ``dtype``; see the module docstring for who reads what.

    ``prepare`` runs on every copy of the model before `fully_shard` (freezing: FSDP2 keeps each
    parameter's ``requires_grad`` as it finds it; LoRA: peft wraps the layers first). Parameters it
    adds that the checkpoint lacks (adapters) are the caller's to fill after loading.
    """
    if not plan.sharded:
        model = load_model(
            model_dir, seed=seed, dtype=dtype, attn_implementation=attn_implementation, device=ctx.device
        )
        if prepare is not None:
            prepare(model)
        return shard_model(model, plan, ctx)
    ensure_process_group(ctx)
    own = _read_own_shards(
        Path(model_dir), dtype=dtype, attn_implementation=attn_implementation, plan=plan, ctx=ctx, prepare=prepare
    )
    if own is not None:
        return own
    # rank 0: the real weights (or the seeded init) on the host, in the checkpoint's dtype
    source_dtype = "auto" if has_weights(model_dir) else dtype  # random init: exactly as one process draws it
    source = None
    if ctx.is_main:
        source = load_model(model_dir, seed=seed, dtype=source_dtype, attn_implementation=attn_implementation)
        if prepare is not None:  # the same structure as the model it fills (LoRA wraps layers, renaming weights)
            prepare(source)
    with torch.device("meta"):
        model = build_model(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    if prepare is not None:
        prepare(model)
    shard_model(model, plan, ctx)
    model.to_empty(device="cpu" if plan.cpu_offload else ctx.device)
    full = source.state_dict() if source is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full, options=options)
    _broadcast_buffers(model, source, ctx)
    del full, source
    return model


def _read_own_shards(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    attn_implementation: str,
    plan: ShardingPlan,
    ctx: DistContext,
    prepare: Callable[[nn.Module], object] | None,
) -> nn.Module | None:
    """The sharded model, each rank having read only its slices of the safetensors files; None: use rank 0."""
    files = safetensors_files(model_dir)
    if not files:
        return None  # pytorch_model*.bin, or a config-only directory (the seeded init is drawn on rank 0)
    with torch.device("meta"):
        model = build_model(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    key_map = checkpoint_key_map(model, checkpoint_keys(files))
    reason = key_map if isinstance(key_map, str) else uncovered(model, key_map)
    buffers = compute_buffers(model) if reason is None else reason
    if isinstance(key_map, str) or isinstance(buffers, str):
        log.warning("%s: rank 0 loads the whole model and broadcasts it (%s)", model_dir, reason or buffers)
        return None
    if prepare is not None:
        prepare(model)
    shard_model(model, plan, ctx)
    model.to_empty(device="cpu" if plan.cpu_offload else ctx.device)
    restore_buffers(model, buffers)
    read = load_own_shards(model, model_dir, key_map)
    log.info(
        "rank %d read %.1f of %.1f MB of %s: its slices of %d tensors",
        ctx.rank,
        read.bytes_read / 1e6,
        read.checkpoint_bytes / 1e6,
        model_dir,
        read.tensors,
    )
    return model


def _broadcast_buffers(model: nn.Module, source: nn.Module | None, ctx: DistContext) -> None:
    """Buffers (rotary frequencies, most not in the state dict) from rank 0's model to every rank's."""
    sources = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if ctx.is_main:
                buffer.copy_(sources[name])
            if ctx.is_distributed:
                dist.broadcast(buffer, src=0)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to the global gradient norm (reduced over the mesh for DTensor gradients); returns it."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def sync_gradients_on(model: nn.Module, micro_index: int, num_micro: int) -> None:
    """Hybrid: all-reduce across nodes only after the last micro-batch (reduce-scatter every one)."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(micro_index == num_micro - 1)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """Every rank calls it; rank 0 gets the whole state dict on the host (the others an empty one).

    Tied weights (an output head tied to the embeddings) come back gathered twice; they are made
    one tensor again so ``save_pretrained`` writes them once, as for an unsharded model.
    """
    state = get_model_state_dict(model, options=_FULL)
    for tied, source in getattr(model, "all_tied_weights_keys", {}).items():
        if tied in state and source in state:
            state[tied] = state[source]
    return state
