"""Energon TaskEncoder: a cooked pack -> one `PackedBatch`; k packs -> one THD micro-batch.

Hooks in Energon's call order (all stateless, so a restored loader replays them exactly):

1. ``cook_crude_sample`` - the shipped cooker (`packvlm.energon.PACK_COOKER`, inherited from
   `packvlm.energon.PackedTaskEncoder`), raw bytes in (``decoder = None``) -> `PackedSample`.
2. ``encode_sample`` - `PackEncoder.encode` on its `LoadedPack`: slot layout, labels, positions,
   vision keywords (the family's layout, `families/<name>/layout.py`).
3. ``batch`` - `train.batch.concat_batches` over Energon's ``batch_size`` = packs per micro-batch,
   joining vision keywords by the layout's ``joins``.
4. ``encode_batch`` - identity.

`PackEncoder` holds a processor bundle and a meta-device model, neither of which should be
pickled into loader workers: the TaskEncoder keeps only paths/config and builds its
`PackEncoder` lazily, once per process. Example (the `train.batch` docstring draws the row)::

    pack: input_ids [a0 a1 a2 b0 b1], loss_mask [0 1 1 0 1], cu_seqlens [0 3 5],
          cu_seqlens_padded [0 4 8]
    ->    input_ids [a0 a1 a2 PAD b0 b1 PAD PAD], labels [-100 a1 a2 -100 -100 b1 -100 -100]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.energon import stateless

from families.layout import IMAGE, VIDEO, Join
from families.processor import load_processor_once
from packvlm.energon import PackedSample, PackedTaskEncoder
from schemas.packed import LoadedPack
from train.batch import IGNORE_INDEX, PackedBatch, concat_batches
from train.identity import ModelConfigSource, load_model_config
from train.image_blocks import empty_spans, image_block_spans
from train.media import DEFAULT_PIXEL_WIRE, MediaProcessor, PackEncodeError, PixelWire
from train.rope import RopeIndex
from train.worker_heap import bound_worker_heap


def slot_layout(pack: LoadedPack, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids [T] and labels [T] in the slot layout (see module docstring)."""
    cu, cp = pack.cu_seqlens, pack.cu_seqlens_padded
    total = int(cp[-1])
    padded = total != int(cu[-1])
    if padded and pad_token_id is None:
        raise PackEncodeError(f"pack {pack.key}: slots hold padding but the tokenizer has no pad token")
    ids = np.full(total, pad_token_id if padded else 0, dtype=np.int64)
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    for i in range(len(cu) - 1):
        src, dst, n = int(cu[i]), int(cp[i]), int(cu[i + 1] - cu[i])
        ids[dst : dst + n] = pack.input_ids[src : src + n]
        keep = pack.loss_mask[src : src + n].astype(bool)
        labels[dst : dst + n] = np.where(keep, ids[dst : dst + n], IGNORE_INDEX)
        labels[dst] = IGNORE_INDEX  # no sample learns its first token from the previous sample
    return torch.from_numpy(ids), torch.from_numpy(labels)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackEncoder:
    """Everything a worker needs to turn packs into micro-batches; `encode` is pure given it."""

    media: MediaProcessor
    rope: RopeIndex
    pad_token_id: int | None

    @classmethod
    def from_pretrained(
        cls, processor: str, model_config: ModelConfigSource, pixels: PixelWire = DEFAULT_PIXEL_WIRE
    ) -> PackEncoder:
        """Load the processor (as `prep tokenize` does, once per process) and the model config.

        ``pixels``: how image pixels leave the worker (`train.media.PixelWire`).
        """
        bundle = load_processor_once(str(processor))
        media = MediaProcessor.from_bundle(bundle, pixels)
        layout, config = media.layout, load_model_config(model_config)
        # a text-only model trained on the text of multimodal data rotates with 1-D positions
        mrope = layout.rope == "mrope" and getattr(config, "vision_config", None) is not None
        rope = RopeIndex.from_config(config, mrope=mrope, mm_token_ids=layout.mm_token_ids)
        return cls(media=media, rope=rope, pad_token_id=bundle.tokenizer.pad_token_id)

    @property
    def joins(self) -> Mapping[str, Join]:
        """How the family's vision keywords join across packs (`train.batch.concat_batches`)."""
        return self.media.layout.joins

    def image_blocks(self, pack: LoadedPack, ids: torch.Tensor) -> torch.Tensor:
        """Bidirectional image blocks of the row (`train.image_blocks`) when the family attends so; else none."""
        layout = self.media.layout
        if getattr(layout, "image_attention", "causal") != "bidirectional":
            return empty_spans()
        frames = getattr(layout, "video_attention", "causal") == "bidirectional"  # each video frame a block (Gemma 4)
        video = layout.mm_token_ids.get(VIDEO) if frames else None
        return image_block_spans(pack, ids, layout.mm_token_ids[IMAGE], video)

    def encode(self, pack: LoadedPack) -> PackedBatch:
        """One pack -> one `PackedBatch` (batch size 1, slot layout)."""
        ids, labels = slot_layout(pack, self.pad_token_id)
        num_samples = len(pack.cu_seqlens) - 1
        vision = self.media.process(pack.key, pack.media, pack.sample_ids, num_samples)
        image_blocks = self.image_blocks(pack, ids)  # after the plan check of every item
        positions = self.rope.positions(ids, pack.cu_seqlens.tolist(), pack.cu_seqlens_padded.tolist(), vision.samples)
        slots = np.diff(pack.cu_seqlens_padded)
        return PackedBatch(
            input_ids=ids[None],
            labels=labels[None],
            position_ids=positions,
            cu_seqlens=torch.from_numpy(pack.cu_seqlens.astype(np.int32)),
            cu_seqlens_padded=torch.from_numpy(pack.cu_seqlens_padded.astype(np.int32)),
            max_seqlen=int(slots.max()) if slots.size else 0,
            mm_token_type_ids=self.rope.mm_token_type_ids(ids)[None],
            vision=vision.tensors,
            image_blocks=image_blocks,
            num_media=vision.num_media,
            num_vision_patches=vision.num_patches,
            pack_keys=(pack.key,),
            sample_ids=tuple(pack.sample_ids),
        )


class PackedBatchTaskEncoder(PackedTaskEncoder[PackedBatch, PackedBatch, PackedBatch]):
    """Energon TaskEncoder for `prep pack` datasets yielding `PackedBatch` micro-batches.

    Plug into any Energon loader (``batch_size`` = packs per micro-batch)::

        get_train_dataset(path, batch_size=k, task_encoder=PackedBatchTaskEncoder(processor_dir, model_dir), ...)
    """

    #: a failing pack is a broken plan, not noise: stop at the first (Energon's default skips 99)
    __default_failure_tolerance__ = 1

    def __init__(self, processor: str, model_config: ModelConfigSource, pixels: PixelWire = DEFAULT_PIXEL_WIRE) -> None:
        super().__init__()
        self.processor = str(processor)
        self.model_config = model_config
        self.pixels = pixels
        self._encoder: PackEncoder | None = None

    @property
    def encoder(self) -> PackEncoder:
        """Built on first use in each process (loader workers included)."""
        if self._encoder is None:
            bound_worker_heap()  # pixel buffers back to the system when freed (train.worker_heap)
            self._encoder = PackEncoder.from_pretrained(self.processor, self.model_config, self.pixels)
        return self._encoder

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_encoder"] = None  # never ship processors / meta models to workers
        return state

    @stateless
    def encode_sample(self, sample: PackedSample) -> PackedBatch:
        return self.encoder.encode(sample.pack)

    @stateless
    def batch(self, samples: list[PackedBatch]) -> PackedBatch:
        return concat_batches(samples, self.encoder.joins)

    @stateless
    def encode_batch(self, batch: PackedBatch) -> PackedBatch:
        return batch
