"""Megatron-LM's ``get_batch`` / ``forward_step`` / ``loss_func`` over a `PackedBatch`.

Megatron-LM (``pretrain_gpt.py``) and Megatron-Bridge (``vlm_step.py``) call a step of the
shape ``forward_step(data_iterator, model) -> (output_tensor, partial(loss_func, loss_mask))``
and a loss ``loss_func(loss_mask, output_tensor) -> (loss_sum, num_tokens, report)``. Their
batch conventions differ from Hugging Face's, and everything here is derived from the
`PackedBatch` fields (never stored twice):

- ``labels`` are **pre-shifted**: ``labels[t]`` is the target of position ``t``, i.e. the HF
  label at ``t + 1``. Positions whose target is not a real label of the **same sample** hold
  ``0`` with ``loss_mask`` 0: the last token of every sample, slot padding, the row's last
  position, and prompt tokens. The boundary rule is structural (from ``cu_seqlens`` /
  ``cu_seqlens_padded``), so no sample ever predicts its neighbour's first token, even from a
  batch whose first labels were left unmasked.
- ``loss_mask`` is float ``[1, T]``; ``attention_mask`` is ``None`` (THD attention takes the
  boundaries from ``packed_seq_params``).
- ``position_ids`` is ``[1, T]``: the per-sample text positions (row 0 of the Qwen-VL
  ``[4, 1, T]`` layout). `mrope_position_ids` gives the ``[3, 1, T]`` t/h/w rows that
  megatron-core's ``mrope`` models read.

The docstring batch of `train.batch` (samples of 3 and 2 tokens, ``--pad-to-multiple-of 4``)::

    tokens        [a0 a1 a2 PAD | b0 b1 PAD PAD]
    HF labels     [-100 a1 a2 -100 | -100 b1 -100 -100]
    labels        [a1 a2 0 0 | b1 0 0 0]          pre-shifted, 0 where masked
    loss_mask     [1 1 0 0 | 1 0 0 0]             3 tokens = batch.num_label_tokens
    position_ids  [0 1 2 3 | 0 1 2 3]

The loss is summed over tokens and the count returned, so Megatron's schedules (with
``calculate_per_token_loss``) and `train.recipes.megatron` divide by the label tokens of the
whole global batch, not by each micro-batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from train.batch import IGNORE_INDEX, PackedBatch
from train.megatron.params import packed_seq_params

LM_LOSS_KEY = "lm loss"  # the reporting key Megatron-LM and Megatron-Bridge log


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronBatch:
    """One micro-batch in Megatron-LM's conventions (batch size 1, THD)."""

    #: int64 [1, T]
    tokens: torch.Tensor
    #: int64 [1, T], pre-shifted; 0 where loss_mask is 0
    labels: torch.Tensor
    #: float32 [1, T]; 1 where labels[t] is a real target of the same sample
    loss_mask: torch.Tensor
    #: int64 [1, T] per-sample text positions
    position_ids: torch.Tensor
    #: megatron.core.packed_seq_params.PackedSeqParams (qkv_format "thd")
    packed_seq_params: Any
    #: always None: THD attention reads the boundaries from packed_seq_params
    attention_mask: None = None


def sample_index(batch: PackedBatch) -> torch.Tensor:
    """``[T]`` int64: the sample each row position belongs to, -1 on slot padding."""
    real = batch.cu_seqlens.long()
    lengths = real[1:] - real[:-1]
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=real.device), lengths)
    offsets = torch.arange(owner.numel(), device=real.device) - torch.repeat_interleave(real[:-1], lengths)
    index = torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=real.device)
    index[batch.cu_seqlens_padded[:-1].long()[owner] + offsets] = owner
    return index.to(batch.labels.device)


def shift_labels(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """HF (unshifted) labels -> Megatron's pre-shifted ``labels`` and float ``loss_mask``.

    Returns:
        ``labels`` int64 ``[1, T]`` and ``loss_mask`` float32 ``[1, T]``; ``labels[t]`` is
        ``batch.labels[t + 1]`` where ``loss_mask[t]`` is 1, else 0.
    """
    owner = sample_index(batch)
    hf = batch.labels.reshape(-1)
    target = hf[1:]
    same_sample = (owner[:-1] == owner[1:]) & (owner[:-1] >= 0)
    valid = same_sample & (target != IGNORE_INDEX)
    labels = torch.zeros_like(hf)
    labels[:-1] = torch.where(valid, target, torch.zeros_like(target))
    loss_mask = torch.zeros(hf.shape, dtype=torch.float32, device=hf.device)
    loss_mask[:-1] = valid.to(torch.float32)
    return labels.view(1, -1), loss_mask.view(1, -1)


def text_position_ids(batch: PackedBatch) -> torch.Tensor:
    """``[1, T]`` per-sample text positions (row 0 of the multimodal layout)."""
    return batch.position_ids if batch.position_ids.dim() == 2 else batch.position_ids[0]


def mrope_position_ids(batch: PackedBatch) -> torch.Tensor:
    """``[3, 1, T]`` t/h/w rotary positions for megatron-core ``mrope`` models (Qwen-VL).

    Raises:
        ValueError: the batch has text-only ``[1, T]`` positions.
    """
    if batch.position_ids.dim() != 3:
        raise ValueError("mrope_position_ids needs the [4, 1, T] multimodal layout; this batch is text-only [1, T]")
    return batch.position_ids[1:]


def get_batch(batch: PackedBatch, device: torch.device | str | None = None) -> MegatronBatch:
    """The micro-batch in Megatron-LM's conventions, on ``device`` (the batch's by default).

    Computed where ``batch`` lives (the loader's CPU tensors), then moved.
    """
    target = batch.input_ids.device if device is None else torch.device(device)
    labels, loss_mask = shift_labels(batch)
    return MegatronBatch(
        tokens=batch.input_ids.to(target, non_blocking=True),
        labels=labels.to(target, non_blocking=True),
        loss_mask=loss_mask.to(target, non_blocking=True),
        position_ids=text_position_ids(batch).to(target, non_blocking=True),
        packed_seq_params=packed_seq_params(batch, device=target),
    )


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Summed masked per-token loss, its token count and Megatron's report (like ``pretrain_gpt``).

    Args:
        loss_mask: float ``[1, T]`` from `get_batch`.
        output_tensor: per-token losses ``[1, T]`` (what ``GPTModel`` returns given ``labels``).

    Returns:
        ``loss`` (fp32 sum over masked tokens), ``num_tokens`` (int tensor) and
        ``{"lm loss": tensor([loss, num_tokens])}``; Megatron-LM sums these pairs over
        micro-batches and data-parallel ranks and logs ``sum(loss) / sum(num_tokens)``.
    """
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    if losses.shape != mask.shape:
        raise ValueError(f"output_tensor has {losses.numel()} losses but loss_mask {mask.numel()} positions")
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {LM_LOSS_KEY: report}


def forward_step(
    data_iterator: Iterator[PackedBatch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]]:
    """One Megatron forward over the next `PackedBatch` of ``data_iterator``.

    Calls ``model(tokens, position_ids, None, labels=..., loss_mask=..., packed_seq_params=...)``
    (megatron-core ``GPTModel.forward``: per-token losses ``[1, T]`` back) on the device of the
    model's parameters, and returns them with ``partial(loss_func, loss_mask)``, which is what
    Megatron-LM's schedules (``get_forward_backward_func()``) expect from a step function.
    """
    batch = get_batch(next(data_iterator), model_device(model))
    output_tensor = model(
        batch.tokens,
        batch.position_ids,
        batch.attention_mask,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        packed_seq_params=batch.packed_seq_params,
    )
    return output_tensor, partial(loss_func, batch.loss_mask)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (CPU for a model without any)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
