"""Packed token loss without full-vocabulary logits: the output head at label positions, in chunks.

`train.loss.token_loss_sum` over `train.forward.packed_forward` materialises ``[T, V]`` logits
(and as many again for the softmax and its gradient): at ``T = 8192`` and a 152k vocabulary
that is 5 GB per fp32 copy, the largest activation of a 7B run. Here the head is applied only
where a loss is taken, a chunk of positions at a time::

    hidden [1, T, H]      = the model's forward with its output head made the identity
                            (the head's input: what the model would have projected)
    keep                  = labels[:, 1:] != -100        # position t predicts labels[t + 1]
    h [N, H], y [N]       = hidden[:, :-1][keep], labels[:, 1:][keep]
    loss_sum              = sum over chunks c of CE(head(h[c]).float(), y[c], reduction="sum")

Each chunk runs under activation checkpointing, so its ``[chunk, V]`` logits are freed after
the forward and recomputed in the backward: peak memory is a few chunks' logits, not ``T``
rows. Sum and count equal ``token_loss_sum(packed_forward(...))`` to fp32 rounding, and so do
the gradients of every parameter (`tests/train/test_chunked_loss.py`).

Why the identity head rather than calling the backbone: the head's input is the only tensor
every image-text-to-text family shares. Some families run their vision merge inside the outer
``forward`` (the Omni thinkers), so ``model.model`` alone would skip it; hooks cannot skip the
head's matmul. The head is ``model.get_output_embeddings()``, swapped for the identity only
during that forward. Anything the forward does to the logits after the head would then act on
the hidden states instead, so the forward's output is checked: it must be the head's own
output (no post-processing), or equal what this module reproduces (Gemma-style
``final_logit_softcapping``); otherwise :class:`OutputHeadError` (exit 2), never a silent
change of the loss. Known refusal: Cohere's ``logit_scale``.

On CUDA with ``liger_kernel`` importable and a plain ``nn.Linear`` head, Liger's fused linear
cross-entropy replaces the checkpointed chunks (it computes the gradients inside its forward,
so no recomputation).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from train.batch import IGNORE_INDEX, PackedBatch
from train.forward import packed_forward
from train.models import ModelLoadError

#: label positions per chunk. 256 x 151,936 fp32 logits are 0.16 GB per copy, about 3.5 copies live
#: at once (benchmarks/bench_train_memory.py: a 2048-token step rises 0.53 GB at 256, 1.9 GB at 1024,
#: equally fast); Liger's own heuristic picks the same for 7B shapes (hidden 3584, vocab 152k).
DEFAULT_CHUNK_SIZE = 256
Backend = Literal["auto", "chunked", "liger"]


class OutputHeadError(ModelLoadError):
    """The model's logits are not its output head applied to its final hidden states."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputHead:
    """The model's output head and the post-processing its forward applies to the logits."""

    module: nn.Module
    #: Gemma-style ``final_logit_softcapping``: logits -> cap * tanh(logits / cap)
    softcap: float | None = None

    def postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        """The forward's own operations, in its order (bitwise the same as the model's)."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.postprocess(self.module(hidden))


def output_head(model: nn.Module) -> OutputHead:
    """``model.get_output_embeddings()`` with the logit softcap its config declares."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    module = get_output_embeddings() if callable(get_output_embeddings) else None
    if not isinstance(module, nn.Module):
        raise OutputHeadError(f"{type(model).__name__} has no output head (get_output_embeddings() is {module!r})")
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "final_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None)
    return OutputHead(module=module, softcap=float(softcap) if softcap else None)


@contextlib.contextmanager
def identity_head(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Make ``module`` return its input for the duration; yields the tensors it was called on.

    An instance attribute shadows the class's ``forward`` (hooks still run); one set earlier
    (accelerate's hooks do this) is put back afterwards.
    """
    calls: list[torch.Tensor] = []
    previous = module.__dict__.get("forward")

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(hidden)
        return hidden

    module.forward = forward
    try:
        yield calls
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def final_hidden_states(model: nn.Module, batch: PackedBatch, head: OutputHead) -> torch.Tensor:
    """What the packed forward feeds its output head, ``[1, T, H]``, checked to be all it does.

    Raises:
        OutputHeadError: the forward did not call the head exactly once, or changed its
            output in a way :meth:`OutputHead.postprocess` does not reproduce.
    """
    with identity_head(head.module) as calls:
        returned = packed_forward(model, batch)
    name = type(model).__name__
    if len(calls) != 1:
        raise OutputHeadError(f"{name}.forward called its output head {len(calls)} times, expected once")
    hidden = calls[0]
    if returned is hidden:
        if head.softcap is None:
            return hidden
        raise OutputHeadError(f"{name} declares final_logit_softcapping {head.softcap}, but its forward omits it")
    expected = head.postprocess(hidden)
    reproduced = (
        returned.shape == hidden.shape
        and returned._base is None  # a slice of the logits (e.g. to a true vocabulary) is not elementwise
        and returned.dtype in (hidden.dtype, torch.float32)
        and torch.equal(returned.float(), expected.float())
    )
    if not reproduced:
        raise OutputHeadError(
            f"{name}.forward post-processes the logits of its output head in a way packvlm does not reproduce "
            f"(it reproduces final_logit_softcapping only); the chunked loss would differ from the model's"
        )
    return hidden


def label_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``[N, H]`` of the positions that predict a label, and those labels ``[N]``.

    Labels are unshifted: position ``t`` predicts ``labels[:, t + 1]``, so the last position
    predicts nothing and positions whose next label is ``IGNORE_INDEX`` are dropped.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[:, :-1][keep], targets[keep]


def _chunk_loss_sum(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head.logits(hidden)  # upcast to fp32 at least: a float64 model (a test's truth) stays float64
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets, reduction="sum")


def chunked_cross_entropy_sum(
    head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Summed fp32 cross-entropy of ``head(hidden)`` against ``targets``, ``chunk_size`` rows at a time.

    Every chunk is checkpointed: its logits live only while that chunk's loss (or, in the
    backward, its gradient) is computed. At least one (possibly empty) chunk runs, so the
    result is connected to the graph and every parameter gets a gradient, as with full logits.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    parts = [
        checkpoint(_chunk_loss_sum, head, hidden[start : start + chunk_size], targets[start : start + chunk_size],
                   use_reentrant=False)
        for start in range(0, max(int(hidden.shape[0]), 1), chunk_size)
    ]  # fmt: skip
    return torch.stack(parts).sum()


@functools.cache
def liger_fused_linear_cross_entropy() -> Callable[..., torch.Tensor] | None:
    """Liger's fused linear cross-entropy when ``liger_kernel`` is installed (GPU only), else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fused
    except ImportError:
        return None
    return fused


def _liger_applies(head: OutputHead, hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and type(head.module) is nn.Linear and liger_fused_linear_cross_entropy() is not None


def _liger_cross_entropy_sum(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    fused = liger_fused_linear_cross_entropy()
    if fused is None or not isinstance(head.module, nn.Linear):
        raise RuntimeError("the liger backend needs liger_kernel and a plain nn.Linear output head")
    loss = fused(
        input=hidden,
        weight=head.module.weight,
        target=targets,
        bias=head.module.bias,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        softcap=head.softcap,
    )
    return loss.float()


def chunked_token_loss_sum(
    model: nn.Module, batch: PackedBatch, *, chunk_size: int = DEFAULT_CHUNK_SIZE, backend: Backend = "auto"
) -> tuple[torch.Tensor, int]:
    """Summed fp32 cross-entropy over the label tokens of a packed micro-batch, and their count.

    Equal to ``token_loss_sum(packed_forward(model, batch), batch.labels)`` (see the module
    docstring) without ever holding ``[T, V]`` logits.

    Args:
        model: As for `train.forward.packed_forward`.
        batch: The micro-batch, already on the model's device.
        chunk_size: Label positions whose logits exist at once (chunked backend).
        backend: ``"chunked"`` (checkpointed chunks, any device), ``"liger"`` (Liger's fused
            kernel), or ``"auto"``: Liger on CUDA when importable and the head is a plain
            ``nn.Linear``, else chunked.
    """
    head = output_head(model)
    hidden, targets = label_positions(final_hidden_states(model, batch, head), batch.labels)
    use_liger = backend == "liger" or (backend == "auto" and _liger_applies(head, hidden))
    if use_liger and hidden.shape[0] > 0:
        total = _liger_cross_entropy_sum(head, hidden, targets)
    else:
        total = chunked_cross_entropy_sum(head, hidden, targets, chunk_size)
    return total, int(targets.numel())
