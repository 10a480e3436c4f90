"""One process per device, alone or under ``torchrun``: rank, world and the reductions we need.

``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; without them the run is a single
process and every collective below is the identity, so the loop reads the same either way.
CPU runs use ``gloo``, CUDA runs ``nccl`` with one GPU per process (``LOCAL_RANK``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from packvlm.errors import ResourceError


class DeviceUnavailableError(ResourceError):
    """The requested device does not exist on this machine."""


class RankLostError(ResourceError):
    """Another rank stopped answering (it died, hung or lost its node): rerun with --resume."""


def lost_peer(exc: BaseException) -> bool:
    """Whether a collective failed because a peer is gone: torch's `DistError` (NCCL, the store),
    or gloo's transport errors, which reach Python as a plain ``RuntimeError`` naming gloo's
    source file ("Timed out waiting 20000ms for recv", "Connection closed by peer")."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "/gloo/transport/" in str(exc))


@dataclass(frozen=True, kw_only=True, slots=True)
class DistContext:
    """Where this process runs and who its peers are."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when present else CPU; ``cuda`` without a GPU is a usage error."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                "--device cuda, but torch sees no CUDA GPU (torch "
                f"{torch.__version__}); install a CUDA build of torch or use --device cpu"
            )
        return torch.device("cuda", local_rank)
    if requested != "cpu":
        raise DeviceUnavailableError(f"unknown --device {requested!r}; use auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(requested_device: str, timeout_s: int | None = None) -> DistContext:
    """Join the ``torchrun`` process group if there is one; pick this process's device.

    ``timeout_s`` bounds how long a collective waits for the other ranks (torch's default: 10 min
    for NCCL, 30 for gloo): past it the call raises, so a rank that died ends the run.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown() -> None:
    """Leave the process group without a barrier: after an error on one rank a barrier would hang."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: float | int, ctx: DistContext) -> float:
    """Sum of a scalar over ranks (float64 on the wire, so token counts stay exact)."""
    if not ctx.is_distributed:
        return float(value)
    device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order (small metadata only: keys, counts)."""
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_main(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank: one rank decides, all act alike (no rank left in a collective)."""
    if not ctx.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_grads(model: torch.nn.Module, ctx: DistContext, divide_by: float = 1.0) -> None:
    """Sum gradients over ranks in one flat buffer, then divide by ``divide_by``.

    Parameters without a gradient on this rank (a vision tower on a text-only micro-batch)
    count as zero, so every rank joins the same all-reduce; DDP's bucket hooks would instead
    report them as unused parameters.
    """
    if not ctx.is_distributed and divide_by == 1.0:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    if ctx.is_distributed:
        dist.all_reduce(flat)
    if divide_by != 1.0:
        flat.div_(divide_by)
    for param, synced in zip(params, _unflatten_dense_tensors(flat, grads)):
        param.grad = synced


def barrier(ctx: DistContext) -> None:
    if ctx.is_distributed:
        dist.barrier()
