"""One packed forward: a `PackedBatch` through a Hugging Face model, samples kept apart.

The call is what FIELD-NOTES "Packed attention" says transformers 5.x needs, and no more::

    model(input_ids [1, T], position_ids [4, 1, T] (VL) or [1, T],
          attention_mask=None, use_cache=False,          # a cache or a mask breaks packing
          cu_seq_lens_q=cu_seq_lens_k=cu_seqlens_padded,   # int32 [S+1] slot offsets
          max_length_q=max_length_k=max_seqlen,
          **batch.vision,                                   # the family's vision keywords
          mm_token_type_ids,                                # where the model accepts it
          packed_image_blocks=ImageBlockRule(...))          # rows with image blocks (Gemma 3), or
                                                            # CUDA without a varlen kernel: a document mask

The boundaries are the *slots* (``cu_seqlens_padded``): a pad token sits at the end of its
slot, attends only to its own sample (causally, so no real token sees it) and has label
-100, so real tokens compute exactly what the sample alone would. Positions are passed, so
the model never runs its whole-row rope index. Text-only causal LMs get no media keywords
and the text row of the positions. A row with bidirectional image blocks (``image_blocks``)
carries one `train.block_attention.ImageBlockRule` to every attention call; only
"packvlm_varlen" reads it, so any other attention implementation is refused for such rows
(transformers' own mask would need ``token_type_ids``, which is per sample, not per row).
On CUDA builds of torch without a varlen kernel (before 2.13) every packed row carries a rule
without blocks, a document mask for flex_attention (`train.attention.needs_document_mask`),
built here once per micro-batch and shared by every layer.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from train.attention import PACKED_ATTENTION, PackedAttentionError, needs_document_mask, prepare_model_for_packing
from train.batch import PackedBatch
from train.block_attention import IMAGE_BLOCKS_KWARG, ImageBlockRule, image_block_layers

_FORWARD_PARAMETERS: dict[type[nn.Module], frozenset[str]] = {}  # one entry per model class


def _forward_parameters(model_type: type[nn.Module]) -> frozenset[str]:
    if model_type not in _FORWARD_PARAMETERS:
        _FORWARD_PARAMETERS[model_type] = frozenset(inspect.signature(model_type.forward).parameters)
    return _FORWARD_PARAMETERS[model_type]


def _check_layout(batch: PackedBatch) -> None:
    """The slot offsets must tile the row, or a kernel would read past it (one host sync)."""
    cu = batch.cu_seqlens_padded.detach().to("cpu", torch.int64)
    lengths = cu.diff()
    if int(cu[0]) != 0 or int(cu[-1]) != batch.num_tokens or bool((lengths < 0).any()):
        raise PackedAttentionError(
            f"packs {batch.pack_keys}: cu_seqlens_padded {cu.tolist()} does not tile a row of {batch.num_tokens} tokens"
        )
    if int(lengths.max()) > batch.max_seqlen:
        raise PackedAttentionError(f"packs {batch.pack_keys}: max_seqlen {batch.max_seqlen} < longest slot")


def packed_inputs(model: nn.Module, batch: PackedBatch) -> dict[str, object]:
    """The keyword arguments of the packed call for ``model`` (see the module docstring)."""
    accepted = _forward_parameters(type(model))
    cu = batch.cu_seqlens_padded.to(device=batch.input_ids.device, dtype=torch.int32)
    position_ids = batch.position_ids
    if position_ids.dim() == 3 and "pixel_values" not in accepted:
        position_ids = position_ids[0]  # a text-only model rotates with the text row
    vision = batch.vision_inputs()
    refused = sorted(set(vision) - accepted)
    if refused:
        raise TypeError(f"{type(model).__name__} takes no {', '.join(refused)}, but packs {batch.pack_keys} carry them")
    inputs: dict[str, object] = {
        "input_ids": batch.input_ids,
        "position_ids": position_ids,
        "attention_mask": None,
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(batch.max_seqlen),
        "max_length_k": int(batch.max_seqlen),
    }
    inputs.update(vision)
    if "mm_token_type_ids" in accepted:
        inputs["mm_token_type_ids"] = batch.mm_token_type_ids
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if batch.image_blocks.numel():
        if implementation != PACKED_ATTENTION:
            raise PackedAttentionError(
                f"packs {batch.pack_keys} hold bidirectional image blocks, which only {PACKED_ATTENTION!r} applies; "
                f"the model uses {implementation!r}"
            )
        inputs[IMAGE_BLOCKS_KWARG] = ImageBlockRule.build(
            batch.cu_seqlens_padded,
            batch.image_blocks.to(batch.input_ids.device),
            batch.num_tokens,
            layers=image_block_layers(getattr(model, "config", None)),
        )
    elif needs_document_mask(batch.input_ids.device, implementation):
        inputs[IMAGE_BLOCKS_KWARG] = ImageBlockRule.build(
            batch.cu_seqlens_padded, batch.image_blocks.to(batch.input_ids.device), batch.num_tokens
        )
    return inputs


def packed_forward(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Logits ``[1, T, V]`` of a packed micro-batch, each sample attending only to itself.

    Args:
        model: A transformers causal LM or image-text-to-text model whose attention
            implementation consumes varlen boundaries ("packvlm_varlen" or "flash_attention_2").
        batch: The micro-batch, already on the model's device.
    """
    prepare_model_for_packing(model)
    _check_layout(batch)
    return model(**packed_inputs(model, batch)).logits
