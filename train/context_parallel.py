"""Context-parallel (CP) slicing of a THD micro-batch: the tokens each CP rank keeps.

With context parallelism of size ``c`` every sample's slot (``cu_seqlens_padded[i]`` ..
``cu_seqlens_padded[i+1]``) is cut into ``2c`` equal chunks and rank ``r`` keeps chunks ``r``
and ``2c-1-r``, in that order, slot after slot. Causal attention costs more late in a sample,
so pairing an early chunk with a late one gives every rank the same work: Megatron's
load-balanced layout (megatron-core ``get_batch_on_this_cp_rank`` per sequence; for THD
``get_thd_batch_on_this_cp_rank``, which takes the index from Transformer Engine's
``thd_get_partitioned_indices``). Attention still gets the whole row's boundaries (TE's ring
attention reads ``cu_seqlens`` / ``cu_seqlens_padded`` unsliced); only the per-token tensors
are cut. Example, slots of 8 and 4 tokens, ``c = 2`` (chunks of 2 and 1)::

    row                 [a0 a1 a2 a3 a4 a5 a6 a7 | b0 b1 b2 b3]    cu_seqlens_padded [0 8 12]
    rank 0 (chunks 0,3) [a0 a1 a6 a7 | b0 b3]                      6 tokens
    rank 1 (chunks 1,2) [a2 a3 a4 a5 | b1 b2]                      6 tokens

Every slot must therefore be a multiple of ``2c`` tokens: write the packs with
``prep pack --pad-to-multiple-of 2c`` (`padding_problem` says so when a dataset is opened).
Slice Megatron's *pre-shifted* labels and loss mask (`train.bridge.shift_labels`), never
Hugging Face labels: the target of a chunk's last token is the first token of the next chunk,
which may live on another rank. Every position row is cut the same way (``[1, T]`` text
positions, ``[3, 1, T]`` mRoPE rows, ``[4, 1, T]``): the sequence is always the last dimension.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from packvlm.errors import UsageError


class ContextParallelPaddingError(UsageError, ValueError):
    """A slot of the micro-batch cannot be split into ``2 * cp`` equal chunks."""


def slot_multiple(cp_size: int) -> int:
    """Tokens every slot must be a multiple of for CP size ``cp_size`` (1 without CP)."""
    if cp_size < 1:
        raise ValueError(f"context parallel size must be >= 1, got {cp_size}")
    return 2 * cp_size if cp_size > 1 else 1


def padding_problem(pad_to_multiple_of: int, cp_size: int) -> str | None:
    """Why packs written with ``--pad-to-multiple-of N`` cannot run at CP ``cp_size``; None if they can."""
    unit = slot_multiple(cp_size)
    if pad_to_multiple_of % unit == 0:
        return None
    return (
        f"context parallel size {cp_size} splits every sample into 2 x {cp_size} = {unit} chunks, so every "
        f"sample slot must be a multiple of {unit} tokens, but the packs were written with "
        f"--pad-to-multiple-of {pad_to_multiple_of}: re-run `prep pack --pad-to-multiple-of {unit}` (or a "
        f"multiple of {unit}) and `prep energon-index`"
    )


def partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions rank ``cp_rank`` keeps, in order: int64 ``[T / cp_size]``.

    Args:
        cu_seqlens_padded: int ``[S+1]`` slot offsets of the row (`train.batch.PackedBatch`).
        cp_size: Context-parallel size ``c``.
        cp_rank: This rank, ``0 <= cp_rank < c``.

    Raises:
        ContextParallelPaddingError: a slot is not a multiple of ``2c`` (names the slot).
    """
    unit = slot_multiple(cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel rank {cp_rank} is not in 0..{cp_size - 1}")
    bounds = cu_seqlens_padded.reshape(-1).long()
    slots = bounds[1:] - bounds[:-1]
    bad = torch.nonzero(slots % unit).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ContextParallelPaddingError(
            f"context parallel size {cp_size} needs every slot to be a multiple of {unit} tokens; slot {i} "
            f"holds {int(slots[i])} ({bad.numel()} of {slots.numel()} slots are not): write the packs with "
            f"`prep pack --pad-to-multiple-of {unit}`"
        )
    if cp_size == 1:
        return torch.arange(int(bounds[-1]), device=bounds.device)
    chunk = slots // unit
    first = bounds[:-1] + cp_rank * chunk
    second = bounds[:-1] + (unit - 1 - cp_rank) * chunk
    begins = torch.stack([first, second], dim=1).reshape(-1)
    lengths = chunk.repeat_interleave(2)
    out_starts = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    return torch.arange(total, device=bounds.device) + torch.repeat_interleave(begins - out_starts, lengths)


def slice_for_rank(
    tensors: Mapping[str, torch.Tensor | None], cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> dict[str, torch.Tensor | None]:
    """Each per-token tensor cut to this rank's tokens along its last (sequence) dimension.

    Args:
        tensors: Per-token tensors of one THD row, e.g. ``tokens``, pre-shifted ``labels``,
            ``loss_mask``, ``position_ids`` (``[1, T]``, ``[3, 1, T]`` or ``[4, 1, T]``); None
            values pass through.
        cu_seqlens_padded: The row's slot offsets (unsliced; attention keeps using them whole).
        cp_size: Context-parallel size.
        cp_rank: This rank.

    Raises:
        ValueError: a tensor's last dimension is not the row length ``cu_seqlens_padded[-1]``.
        ContextParallelPaddingError: a slot is not a multiple of ``2 * cp_size``.
    """
    num_tokens = int(cu_seqlens_padded[-1])
    index = partition_index(cu_seqlens_padded, cp_size, cp_rank)
    out: dict[str, torch.Tensor | None] = {}
    for name, value in tensors.items():
        if value is None:
            out[name] = None
            continue
        if value.shape[-1] != num_tokens:
            raise ValueError(
                f"{name} has {value.shape[-1]} positions in its last dimension, the row has {num_tokens}: only "
                "per-token tensors are sliced for context parallelism"
            )
        out[name] = value.index_select(-1, index.to(value.device))
    return out
