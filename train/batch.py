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

``position_ids`` is ``[1, T]`` for every family whose rotary positions are 1-D (LLaVA,
Pixtral / Mistral 3, InternVL, Idefics3 / SmolVLM, Gemma 3): restarting per slot is all the
packing they need.

``vision`` holds the keyword arguments of the family's model ``forward`` for the media of the
whole row, in token order, as its family layout (`families/<name>/layout.py`) declares them, e.g.::

    Qwen2/2.5/3-VL, GLM, Omni  pixel_values [patches, C*t*p*p], image_grid_thw [N, 3],
                               pixel_values_videos, video_grid_thw, second_per_grid_ts
    Pixtral / Mistral 3        pixel_values [N, 3, H_max, W_max] (zero-padded), image_sizes [N, 2]
    LLaVA-NeXT / OneVision     pixel_values [N, tiles_max, 3, S, S], image_sizes [N, 2], batch_num_images
    Idefics3 / SmolVLM         pixel_values [1, tiles, 3, S, S], pixel_attention_mask [1, tiles, S, S]
    InternVL                   pixel_values [tiles, 3, S, S]

How a keyword joins across packs (``--packs-per-microbatch``) is the layout's ``joins``; a
text-only row has an empty ``vision``.

Image ``pixel_values`` arrive as `train.pixels.PackedPixels` (8-bit values, the processor's
per-value table, frame extents) unless the loader was asked for ``pixels="float32"``: a
quarter of the bytes through the workers' shared memory. A loop moves the batch with ``.to``
and reads ``vision_inputs()``, which makes the processor's float32 tensors there (bit-equal);
a `PackedPixels` handed to a model as it is fails loudly, never silently.

``image_blocks`` (int32 ``[N, 2]``) lists the ``[start, end)`` row offsets of every image
block that attends bidirectionally (families whose layout declares ``image_attention =
"bidirectional"``: Gemma 3, one block per tile's run of soft tokens), in row order; empty for
every other family. They come from the stored media plan (`train.image_blocks`) and shift
with their pack in `concat_batches`. Example, Gemma 3 with 4 soft tokens per tile, sample 1
holding one image::

    input_ids          [a0 a1 a2 PAD | b0 B s s s s E b1 PAD PAD PAD PAD]
    image_blocks       [[6, 10]]
    attention          same slot AND (causal OR same block); sliding layers AND kv > q - window
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from families.layout import Join
from train.join import VisionValue, join_fields
from train.pixels import PackedPixels, vision_inputs

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
    #: the family model's vision keywords for the row (see the module docstring); empty without media.
    #: Pixels may be `PackedPixels`: pass ``vision_inputs()`` to a model, not this
    vision: dict[str, VisionValue] = field(default_factory=dict)
    #: int32 [N, 2] ``[start, end)`` row offsets of bidirectional image blocks (Gemma 3); empty otherwise
    image_blocks: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 2), dtype=torch.int32))
    #: images plus videos in the row
    num_media: int = 0
    #: patches the vision encoder embeds for the row (its share of the compute)
    num_vision_patches: int = 0
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

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """The model's vision keywords, 8-bit pixels normalised where they lie (after ``.to(device)``)."""
        return vision_inputs(self.vision)

    def _vision_tensor(self, name: str) -> torch.Tensor | None:
        value = self.vision.get(name)
        return value.normalized() if isinstance(value, PackedPixels) else value

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """The model's float ``pixel_values`` (normalised here when shipped as 8-bit)."""
        return self._vision_tensor("pixel_values")

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return self._vision_tensor("image_grid_thw")

    @property
    def pixel_values_videos(self) -> torch.Tensor | None:
        return self._vision_tensor("pixel_values_videos")

    @property
    def video_grid_thw(self) -> torch.Tensor | None:
        return self._vision_tensor("video_grid_thw")

    @property
    def vision_nbytes(self) -> int:
        """Bytes of the vision keywords as they travel (8-bit pixels count as shipped)."""
        return sum(v.nbytes for v in self.vision.values())

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device`` (non-blocking where pinned)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> PackedBatch:
        """Pinned host copies (torch's DataLoader calls this when ``pin_memory`` is on)."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, move: Callable[[Any], Any]) -> PackedBatch:
        moved: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = move(value) if isinstance(value, torch.Tensor) else value
        moved["vision"] = {k: move(v) for k, v in self.vision.items()}
        return PackedBatch(**moved)


def concat_batches(batches: Sequence[PackedBatch], joins: Mapping[str, Join]) -> PackedBatch:
    """k packs -> one THD row (``--packs-per-microbatch k``); pure.

    Token tensors are joined along the row; ``cu_seqlens`` continue from the previous packs'
    real-token total, ``cu_seqlens_padded`` and ``image_blocks`` from their row length, so sample
    boundaries and image blocks stay exact; vision keywords are joined in order by the family
    layout's ``joins`` (token order is preserved because packs are). Example, packs with
    ``cu_seqlens_padded`` [0 4 8] and [0 3]: the row has ``cu_seqlens_padded`` [0 4 8 11].
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    if len({b.position_ids.dim() for b in batches}) != 1:
        raise ValueError("cannot concatenate text-only [1, T] and multimodal [4, 1, T] position_ids")
    unknown = {k for b in batches for k in b.vision} - set(joins)
    if unknown:
        raise ValueError(f"no join rule for vision keywords {sorted(unknown)}")
    real, padded = [batches[0].cu_seqlens], [batches[0].cu_seqlens_padded]
    blocks = [batches[0].image_blocks]
    real_offset, row_offset = int(batches[0].cu_seqlens[-1]), batches[0].num_tokens
    for b in batches[1:]:
        real.append(b.cu_seqlens[1:] + real_offset)
        padded.append(b.cu_seqlens_padded[1:] + row_offset)
        blocks.append(b.image_blocks + row_offset)
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
        vision=join_fields(joins, [b.vision for b in batches]),
        image_blocks=torch.cat(blocks),
        num_media=sum(b.num_media for b in batches),
        num_vision_patches=sum(b.num_vision_patches for b in batches),
        pack_keys=tuple(k for b in batches for k in b.pack_keys),
        sample_ids=tuple(s for b in batches for s in b.sample_ids),
    )
