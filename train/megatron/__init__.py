"""megatron-core's ``PackedSeqParams`` from a `PackedBatch`, for people who run Megatron-LM themselves.

- `packed_seq_params(batch)`: the THD boundaries as megatron-core's ``PackedSeqParams``
  (``train.megatron.params``); `check_context_parallel` says which slot breaks ``2 * cp``.

`train megatron` runs Megatron-Bridge (``train.recipes.megatron``), whose VLM step builds its own
``PackedSeqParams`` from the batch of `train.bridge`. Nothing here imports megatron-core at module
import.
"""

from __future__ import annotations

from train.context_parallel import ContextParallelPaddingError
from train.megatron.params import (
    MegatronNotInstalledError,
    PackedSeqFields,
    check_context_parallel,
    packed_seq_fields,
    packed_seq_params,
)

__all__ = [
    "ContextParallelPaddingError",
    "MegatronNotInstalledError",
    "PackedSeqFields",
    "check_context_parallel",
    "packed_seq_fields",
    "packed_seq_params",
]
