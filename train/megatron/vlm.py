"""A megatron-core language model with the family's HF vision tower, over packed THD micro-batches.

`MegatronVLM` is what `train megatron` trains when the packs hold images (or when context
parallelism cuts the row): the row's token embeddings come from the GPT model's own embedding
layer, the family's vision tower (`train.megatron.vision.HFVisionEncoder`) replaces the rows of
the image (and video) placeholder tokens, the row is cut to this context-parallel rank's tokens
(`train.context_parallel.partition_index`) and goes into ``GPTModel.forward`` as
``decoder_input``, with the whole row's boundaries in ``PackedSeqParams`` (THD). Order matters:
the merge happens on the whole row, so every placeholder gets its own image whatever rank keeps
it, and only then is the row cut (as Megatron-Bridge's HF-encoder models do).

`get_vlm_batch` gives the step's inputs from a `PackedBatch`; for the `train.batch` docstring
row (samples of 3 and 2 tokens, ``--pad-to-multiple-of 4``) at CP size 2, rank 0::

    tokens         [a0 a1 a2 PAD b0 b1 PAD PAD]           whole row: the merge needs every placeholder
    cp_index       [0 3 4 7]                              slot chunks 0 and 3 (train.context_parallel)
    labels         [a1 0 | b1 0]                          pre-shifted (train.megatron.step), then cut
    loss_mask      [1 0 | 1 0]
    position_ids   [1, T] text row, or [3, 1, T] t/h/w rows (mRoPE), whole row (below)
    packed_seq_params  cu_seqlens [0 3 5], cu_seqlens_padded [0 4 8], max_seqlen 4: whole row

Positions stay whole: megatron-core's THD rope (`_apply_rotary_pos_emb_thd`) takes, per sample,
the chunks of this rank out of the whole row's frequencies when they span the row (mRoPE: one
frequency row per token, so `train.megatron.model` keeps its mRoPE embedding from cutting them),
and computes 1-D frequencies from 0 per sample otherwise (where the text row is unused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from train.batch import PackedBatch
from train.context_parallel import partition_index
from train.megatron.params import packed_seq_params
from train.megatron.step import loss_func, model_device, mrope_position_ids, shift_labels, text_position_ids
from train.megatron.vision import HFVisionEncoder, scatter_media
from train.pixels import vision_inputs


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronVLMBatch:
    """One micro-batch for `MegatronVLM` on one context-parallel rank (batch size 1, THD)."""

    #: int64 [1, T], the whole row
    tokens: torch.Tensor
    #: int64 [1, T / cp], pre-shifted, this rank's tokens
    labels: torch.Tensor
    #: float32 [1, T / cp]
    loss_mask: torch.Tensor
    #: int64 [1, T] text positions or [3, 1, T] mRoPE rows, the whole row
    position_ids: torch.Tensor
    #: megatron.core PackedSeqParams of the whole row
    packed_seq_params: Any
    #: the family model's vision keywords (PackedBatch.vision); empty for text
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    #: int64 [T / cp] row positions this rank keeps; None without context parallelism
    cp_index: torch.Tensor | None = None


def get_vlm_batch(
    batch: PackedBatch,
    device: torch.device | str | None = None,
    *,
    mrope: bool = False,
    context_parallel_size: int = 1,
    context_parallel_rank: int = 0,
) -> MegatronVLMBatch:
    """`MegatronVLM`'s inputs for ``batch`` on one context-parallel rank, on ``device``.

    Args:
        batch: One packed micro-batch.
        device: Where the tensors go (the batch's own device by default).
        mrope: Give the ``[3, 1, T]`` t/h/w rows (``PackedBatch.position_ids[1:]``) instead of the text row.
        context_parallel_size: CP size ``c``; every slot must be a multiple of ``2c``.
        context_parallel_rank: This rank.

    Raises:
        ContextParallelPaddingError: a slot is not a multiple of ``2c``.
    """
    target = batch.input_ids.device if device is None else torch.device(device)
    labels, loss_mask = shift_labels(batch)
    cp_index = None
    if context_parallel_size > 1:
        cp_index = partition_index(batch.cu_seqlens_padded, context_parallel_size, context_parallel_rank)
        labels, loss_mask = labels[:, cp_index], loss_mask[:, cp_index]
    positions = mrope_position_ids(batch) if mrope else text_position_ids(batch)
    return MegatronVLMBatch(
        tokens=batch.input_ids.to(target, non_blocking=True),
        labels=labels.to(target, non_blocking=True),
        loss_mask=loss_mask.to(target, non_blocking=True),
        position_ids=positions.to(target, non_blocking=True),
        packed_seq_params=packed_seq_params(batch, device=target, context_parallel_size=context_parallel_size),
        # 8-bit pixels (train.pixels) become the processor's floats on the GPU
        vision=vision_inputs({k: v.to(target, non_blocking=True) for k, v in batch.vision.items()}),
        cp_index=None if cp_index is None else cp_index.to(target),
    )


class MegatronVLM(torch.nn.Module):
    """A megatron-core ``GPTModel`` fed merged text + vision embeddings (``decoder_input``).

    Args:
        language_model: The ``GPTModel`` (its ``embedding`` embeds the tokens).
        vision: The family's HF vision tower and projector; None trains the text (the placeholder
            tokens embedded like any token), e.g. for context parallelism without images.
        mrope: The language model rotates with t/h/w sections (`get_vlm_batch(mrope=True)`).
    """

    def __init__(self, language_model: torch.nn.Module, vision: HFVisionEncoder | None, *, mrope: bool) -> None:
        super().__init__()
        self.language_model = language_model
        self.vision = vision
        self.mrope = mrope

    def decoder_input(
        self, tokens: torch.Tensor, vision: dict[str, torch.Tensor], cp_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[T / cp, 1, H]``: token embeddings, media rows replaced by the vision tower's, cut to this rank."""
        embedding: Any = self.language_model.embedding  # megatron-core LanguageModelEmbedding
        embeds = embedding(input_ids=tokens, position_ids=None)  # [T, 1, H]
        if self.vision is not None and vision:
            embeds = scatter_media(embeds, tokens, self.vision.embeddings(vision))
        return embeds if cp_index is None else embeds.index_select(0, cp_index)

    def forward(self, batch: MegatronVLMBatch) -> torch.Tensor:
        """Per-token losses ``[1, T / cp]`` of this rank's tokens (``GPTModel`` given ``labels``)."""
        output: torch.Tensor = self.language_model(
            input_ids=None,
            position_ids=batch.position_ids,
            attention_mask=None,
            decoder_input=self.decoder_input(batch.tokens, batch.vision, batch.cp_index),
            labels=batch.labels,
            loss_mask=batch.loss_mask,
            packed_seq_params=batch.packed_seq_params,
        )
        return output


def vlm_forward_step(
    data_iterator: Iterator[PackedBatch],
    model: MegatronVLM,
    *,
    context_parallel_size: int = 1,
    context_parallel_rank: int = 0,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]]:
    """`train.megatron.step.forward_step` for `MegatronVLM`: this rank's losses, ``partial(loss_func, loss_mask)``."""
    batch = get_vlm_batch(
        next(data_iterator),
        model_device(model),
        mrope=model.mrope,
        context_parallel_size=context_parallel_size,
        context_parallel_rank=context_parallel_rank,
    )
    return model(batch), partial(loss_func, batch.loss_mask)
