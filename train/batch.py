"""The packed micro-batch every `train` loop consumes: one THD row, declared once.

A micro-batch is ``k`` packs (``--packs-per-microbatch``) concatenated into a single row
(batch size 1). Sample ``i`` owns the slot ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``;
its real tokens are the first ``cu_seqlens[i+1] - cu_seqlens[i]`` of that slot, the rest of
the slot (only when the pack was written with ``--pad-to-multiple-of``) holds pad tokens with
label -100. Without padding both boundary arrays are equal and the row holds no padding at
all: the GPU does no work on pad tokens. Example, two samples of 3 and 2 tokens,
``pad_to_multiple_of=4``, sample 0 starts with a masked prompt token::

    input_ids          [a0 a1 a2 PAD | b0 b1 PAD PAD]          T = 8
    labels             [-100 a1 a2 -100 | -100 b1 -100 -100]   first token of each sample: -100
    position_ids[0]    [0 1 2 3 | 0 1 2 3]                      text positions restart per slot
    cu_seqlens         [0 3 5]                                  cumsum of real lengths (TE / Megatron)
    cu_seqlens_padded  [0 4 8]                                  slot offsets into the row
    max_seqlen         4                                        longest slot

``labels`` are *unshifted* (Hugging Face convention: the model predicts ``labels[t]`` from
the logits at ``t - 1``). Masking every sample's first label means no sample learns to
predict its first token from the previous sample's last one. Megatron's pre-shifted labels
and loss mask are derived from these by `train.megatron` (never stored twice).

``position_ids`` is ``[1, T]`` for text-only models and ``[4, 1, T]`` for the Qwen-VL
families: row 0 the per-sample text positions, rows 1-3 the model's own multimodal rope
index (t/h/w) computed for each sample alone and concatenated. That 4-row layout is what
transformers needs to detect packing (``position_ids[0]`` restarts at 0) while rotating
with the real mRoPE positions (see FIELD-NOTES "Packed attention").

Media are concatenated in token order across the micro-batch: ``pixel_values`` /
``image_grid_thw`` for images, ``pixel_values_videos`` / ``video_grid_thw`` (and
``second_per_grid_ts`` for Qwen2.5-VL) for videos, exactly as the model's processor returns
them for one sample, stacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

IGNORE_INDEX = -100  # label of tokens that carry no loss (torch / HF cross-entropy default)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """One THD micro-batch (batch size 1); see the module docstring for the layout."""

    #: int64 [1, T]
    input_ids: torch.Tensor
    #: int64 [1, T]; IGNORE_INDEX where loss_mask is 0, at each sample's first token, on pad slots
    labels: torch.Tensor
    #: int64 [1, T] (text-only) or [4, 1, T] (Qwen-VL mRoPE: text row, then t/h/w rows)
    position_ids: torch.Tensor
    #: int32 [S+1] cumsum of the samples' real lengths
    cu_seqlens: torch.Tensor
    #: int32 [S+1] slot offsets into the row (equal to cu_seqlens without --pad-to-multiple-of)
    cu_seqlens_padded: torch.Tensor
    #: longest slot in tokens
    max_seqlen: int
    #: int [1, T]: 0 text, 1 image token, 2 video token (what transformers' rope index reads)
    mm_token_type_ids: torch.Tensor
    #: float [N_patches, C*t*p*p] for the images of all samples, in token order; None if none
    pixel_values: torch.Tensor | None = None
    #: int64 [N_images, 3]
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    #: int64 [N_videos, 3]
    video_grid_thw: torch.Tensor | None = None
    #: float [N_videos] seconds per temporal grid step (Qwen2.5-VL only)
    second_per_grid_ts: torch.Tensor | None = None
    #: webdataset keys of the packs in this micro-batch, in order
    pack_keys: tuple[str, ...] = ()
    #: tokenized sample ids, in row order (trace any token back to `prep tokenize` rows)
    sample_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Length T of the row, pad slots included."""
        return int(self.input_ids.shape[-1])

    @property
    def num_real_tokens(self) -> int:
        """Tokens that belong to a sample (T minus slot padding)."""
        return int(self.cu_seqlens[-1])

    @property
    def num_label_tokens(self) -> int:
        """Tokens that carry loss; the normaliser of a token-weighted mean."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_media(self) -> int:
        """Images plus videos in the micro-batch."""
        grids = (self.image_grid_thw, self.video_grid_thw)
        return sum(int(g.shape[0]) for g in grids if g is not None)

    @property
    def num_vision_patches(self) -> int:
        """Patches the vision tower encodes (before spatial merging): its share of the compute."""
        grids = (self.image_grid_thw, self.video_grid_thw)
        return sum(int(g.prod(-1).sum()) for g in grids if g is not None)

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device`` (non-blocking where pinned)."""
        moved: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            moved[field.name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        return PackedBatch(**moved)


def _cat_optional(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def concat_batches(batches: Sequence[PackedBatch]) -> PackedBatch:
    """k packs -> one THD row (``--packs-per-microbatch k``); pure.

    Token tensors are joined along the row; ``cu_seqlens`` continue from the previous packs'
    real-token total and ``cu_seqlens_padded`` from their row length, so sample boundaries stay
    exact; media are joined in order (token order is preserved because packs are). Example,
    packs with ``cu_seqlens_padded`` [0 4 8] and [0 3]: the row has ``cu_seqlens_padded``
    [0 4 8 11].
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    if len({b.position_ids.dim() for b in batches}) != 1:
        raise ValueError("cannot concatenate text-only [1, T] and multimodal [4, 1, T] position_ids")
    real, padded = [batches[0].cu_seqlens], [batches[0].cu_seqlens_padded]
    real_offset, row_offset = int(batches[0].cu_seqlens[-1]), batches[0].num_tokens
    for b in batches[1:]:
        real.append(b.cu_seqlens[1:] + real_offset)
        padded.append(b.cu_seqlens_padded[1:] + row_offset)
        real_offset += int(b.cu_seqlens[-1])
        row_offset += b.num_tokens
    return PackedBatch(
        input_ids=torch.cat([b.input_ids for b in batches], dim=-1),
        labels=torch.cat([b.labels for b in batches], dim=-1),
        position_ids=torch.cat([b.position_ids for b in batches], dim=-1),
        cu_seqlens=torch.cat(real),
        cu_seqlens_padded=torch.cat(padded),
        max_seqlen=max(b.max_seqlen for b in batches),
        mm_token_type_ids=torch.cat([b.mm_token_type_ids for b in batches], dim=-1),
        pixel_values=_cat_optional([b.pixel_values for b in batches]),
        image_grid_thw=_cat_optional([b.image_grid_thw for b in batches]),
        pixel_values_videos=_cat_optional([b.pixel_values_videos for b in batches]),
        video_grid_thw=_cat_optional([b.video_grid_thw for b in batches]),
        second_per_grid_ts=_cat_optional([b.second_per_grid_ts for b in batches]),
        pack_keys=tuple(k for b in batches for k in b.pack_keys),
        sample_ids=tuple(s for b in batches for s in b.sample_ids),
    )
