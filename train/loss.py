"""Token-level loss of packed rows, normalised by the label tokens of the whole global batch.

The mean of per-micro-batch means weights a token by ``1 / (label tokens of its micro-batch)``
and so depends on how samples fell into packs and ranks: the classic packed /
gradient-accumulation bug. Instead every micro-batch returns a *sum* and its count, and the
loop divides by the global count over all accumulation steps and ranks::

    n = global_label_tokens(micro_batches)          # all_reduce over ranks when initialised
    for batch in micro_batches:
        loss_sum, _ = chunked_token_loss_sum(model, batch)   # = token_loss_sum(packed_forward(...))
        (loss_sum / n).backward()                   # every label token weighs 1 / n

`train hf` takes the sum from `train.chunked_loss.chunked_token_loss_sum`, which never holds
``[T, V]`` logits; `token_loss_sum` over full logits is its reference and stays for callers
that want the logits.

Labels are unshifted (HF convention): the logits at ``t`` predict ``labels[t + 1]``. Across a
sample boundary the target is the next sample's first token, which `PackedBatch` masks, so no
sample is trained to predict its first token from its neighbour.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn import functional as F

from train.batch import IGNORE_INDEX, PackedBatch


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32 for the softmax: bf16/fp16 go up, fp64 (the tests' exact truth) stays."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _shifted(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    return upcast(logits[:, :-1]).flatten(0, 1), labels[:, 1:].flatten()


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per predicted position ``[B, T-1]`` in fp32; 0 where the target is ignored."""
    flat_logits, targets = _shifted(logits, labels)
    losses = F.cross_entropy(flat_logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view(labels.shape[0], labels.shape[1] - 1)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed fp32 cross-entropy over the label tokens, and how many there are.

    Args:
        logits: ``[B, T, V]`` (any float dtype; upcast to fp32 for the softmax).
        labels: ``[B, T]`` unshifted, ``IGNORE_INDEX`` where no loss is taken.
    """
    flat_logits, targets = _shifted(logits, labels)
    total = F.cross_entropy(flat_logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((targets != IGNORE_INDEX).sum())


def global_label_tokens(batches: Iterable[PackedBatch], group: dist.ProcessGroup | None = None) -> int:
    """Label tokens of ``batches`` summed over the ranks of ``group`` (all of them by default).

    Every rank must call it with its own micro-batches of the same optimizer step; without an
    initialised process group it is the local count.
    """
    local = sum(batch.num_label_tokens for batch in batches)
    if not (dist.is_available() and dist.is_initialized()):
        return local
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    count = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())
