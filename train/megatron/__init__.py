"""The Megatron side of `train`: a `PackedBatch` in Megatron-LM's / Megatron-Bridge's terms.

Importable pieces for people who already run Megatron-LM or Megatron-Bridge, in call order:

- `packed_seq_params(batch)`: the THD boundaries as megatron-core's ``PackedSeqParams``
  (``train.megatron.params``);
- `get_batch(batch, device)`: tokens, pre-shifted labels, float loss mask, ``None``
  attention mask, per-sample position ids and the packed-sequence params
  (``train.megatron.step``);
- `forward_step(data_iterator, model)` / `loss_func(loss_mask, output_tensor)`: shaped like
  Megatron-LM's ``pretrain_gpt.py`` pair (loss summed over tokens, token count returned).

With images (import them from ``train.megatron.vlm`` and ``train.megatron.vision``: this package
is imported by `train.context_parallel`, which ``vlm`` imports in turn):

- `HFVisionEncoder(hf_config)`: the family's own Hugging Face vision tower and projector;
- `MegatronVLM(gpt_model, encoder, mrope=...)` and `vlm_forward_step`: the image rows of
  ``decoder_input`` written by the tower, the row cut per context-parallel rank, ``[3, 1, T]``
  mRoPE rows for Qwen2/2.5-VL (`get_vlm_batch`).

`train megatron` (``train.recipes.megatron``) runs them on a megatron-core
``GPTModel`` with the Transformer Engine layer spec. Nothing here imports megatron-core or
Transformer Engine at module import: the package imports on any machine, and only the calls
that need them say what to install.
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
from train.megatron.step import MegatronBatch, forward_step, get_batch, loss_func, mrope_position_ids, shift_labels

__all__ = [
    "ContextParallelPaddingError",
    "MegatronBatch",
    "MegatronNotInstalledError",
    "PackedSeqFields",
    "check_context_parallel",
    "forward_step",
    "get_batch",
    "loss_func",
    "mrope_position_ids",
    "packed_seq_fields",
    "packed_seq_params",
    "shift_labels",
]
