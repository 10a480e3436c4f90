"""`PackedBatch` boundaries -> megatron-core ``PackedSeqParams`` (THD), read from the batch only.

megatron-core hands every field of ``PackedSeqParams`` to Transformer Engine's
``DotProductAttention`` and uses the boundaries for the THD rotary embedding. For the batch
of the `train.batch` docstring (samples of 3 and 2 tokens, ``--pad-to-multiple-of 4``)::

    qkv_format            "thd"
    cu_seqlens_q/kv       [0 3 5]    int32, cumsum of the real lengths (what attention sees)
    cu_seqlens_q/kv_padded [0 4 8]   int32, slot offsets into the row (where each sample sits)
    max_seqlen_q/kv       4          Python int: the longest slot

Choices, checked against megatron-core 0.16 and Transformer Engine 2.x:

- The padded boundaries are **always** passed, equal or not, as megatron-core's own THD
  helper (``megatron.core.utils.get_thd_batch_on_this_cp_rank``) does. TE treats a padded
  array equal to the real one as "no padding between sequences" (it compares them) and keeps
  its flash-attention backend; megatron-core's THD rotary embedding restarts positions at
  ``cu_seqlens_*_padded`` when given, which is where `PackedBatch` restarts its text
  positions; and context parallelism needs them. Megatron-Bridge passes them only when they
  differ, which gives the same attention.
- ``max_seqlen`` is a Python ``int`` (the field's annotation; megatron-core's rotary
  embedding caches on it and builds ``arange(max_seqlen)``), not an int32 tensor.
- Slot padding needs bf16/fp16 attention: Transformer Engine's fp32 (unfused) backend takes
  THD only when the padded and real boundaries are equal (seen with TE 2.11); the fused
  backends take both. `train megatron` runs under bf16 autocast.
- Context parallelism (cp > 1) splits every sample into ``2 * cp`` chunks (load-balanced
  causal split), so every slot length must be a multiple of ``2 * cp``: write the packs with
  ``prep pack --pad-to-multiple-of 2*cp``. `check_context_parallel` says so by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from packvlm.errors import ResourceError
from train.batch import PackedBatch
from train.context_parallel import ContextParallelPaddingError

MEGATRON_INSTALL_HINT = (
    "pip install 'packvlm[megatron]' (megatron-core); THD attention also needs a CUDA GPU and "
    "Transformer Engine: pip install --no-build-isolation 'transformer_engine[pytorch]'"
)


class MegatronNotInstalledError(ResourceError, ImportError):
    """megatron-core (or Transformer Engine) is needed for this call and is not importable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedSeqFields:
    """The values of megatron-core's ``PackedSeqParams``, one field each (no megatron import)."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


def packed_seq_fields(batch: PackedBatch, *, device: torch.device | str | None = None) -> PackedSeqFields:
    """The THD parameters of ``batch`` as plain values (int32 boundaries on ``device``).

    Args:
        batch: One packed micro-batch.
        device: Where the boundary tensors go; the batch's own device by default.
    """
    target = batch.cu_seqlens.device if device is None else torch.device(device)
    real = batch.cu_seqlens.to(device=target, dtype=torch.int32)
    padded = batch.cu_seqlens_padded.to(device=target, dtype=torch.int32)
    return PackedSeqFields(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(batch.max_seqlen),
        max_seqlen_kv=int(batch.max_seqlen),
    )


def packed_seq_params(
    batch: PackedBatch, *, device: torch.device | str | None = None, context_parallel_size: int = 1
) -> Any:
    """megatron-core ``PackedSeqParams(qkv_format="thd", ...)`` for ``batch``.

    Args:
        batch: One packed micro-batch.
        device: Where the boundary tensors go (the GPU for TE); the batch's device by default.
        context_parallel_size: Checked with `check_context_parallel` when above 1.

    Raises:
        MegatronNotInstalledError: megatron-core is not installed.
        ContextParallelPaddingError: a slot is not a multiple of ``2 * context_parallel_size``.
    """
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as err:
        raise MegatronNotInstalledError(f"packed_seq_params needs megatron-core: {MEGATRON_INSTALL_HINT}") from err
    check_context_parallel(batch, context_parallel_size)
    fields = packed_seq_fields(batch, device=device)
    return PackedSeqParams(
        qkv_format=fields.qkv_format,
        cu_seqlens_q=fields.cu_seqlens_q,
        cu_seqlens_kv=fields.cu_seqlens_kv,
        cu_seqlens_q_padded=fields.cu_seqlens_q_padded,
        cu_seqlens_kv_padded=fields.cu_seqlens_kv_padded,
        max_seqlen_q=fields.max_seqlen_q,
        max_seqlen_kv=fields.max_seqlen_kv,
    )


def check_context_parallel(batch: PackedBatch, context_parallel_size: int) -> None:
    """Raise unless every slot of ``batch`` is a multiple of ``2 * context_parallel_size``.

    Raises:
        ContextParallelPaddingError: naming the first offending sample, its slot length and
            the ``prep pack`` flag that fixes it.
    """
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
    if context_parallel_size == 1:
        return
    unit = 2 * context_parallel_size
    slots = (batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]).tolist()
    bad = [i for i, n in enumerate(slots) if n % unit]
    if not bad:
        return
    i = bad[0]
    sample = batch.sample_ids[i] if i < len(batch.sample_ids) else f"#{i}"
    packs = ", ".join(batch.pack_keys) or "?"
    raise ContextParallelPaddingError(
        f"context parallel size {context_parallel_size} needs every sample slot to be a multiple of "
        f"2 x {context_parallel_size} = {unit} tokens; {len(bad)} of {len(slots)} slots are not "
        f"(first: sample {sample}, slot of {slots[i]} tokens, pack {packs}). "
        f"Re-pack with `prep pack --pad-to-multiple-of {unit}` (or a multiple of it)."
    )
