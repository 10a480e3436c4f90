"""Gemma 4 (``Gemma4Processor``): one padded patch sequence per image, soft tokens per its size.

The image processor (``Gemma4ImageProcessorPil``) resizes each image (`families.gemma4.settings`),
patchifies it into 16 px patches (channels last inside a patch) and pads the sequence to
``max_soft_tokens * 9`` patches: ``pixel_values`` [1, max_patches, 768] and
``image_position_ids`` [1, max_patches, 2] (x, y of each patch, -1 on padding). Every image of
one processor has the same padded length, so items, samples and packs join ``cat``; the vision
tower encodes each image alone (its own bidirectional mask over its real patches) and drops the
padding, and the model scatters the pooled soft tokens into the runs of ``<|image|>`` in order.

What the plan is checked against, in `families.gemma4.counter`'s convention: one tile,
``num_tokens`` = ``num_soft_tokens_per_image``, grid (1, rows, cols) of soft tokens (the real
patch grid over 3). Example (example ``gemma4``): a 90 x 60 image -> resized 768 x 528 (w x h)
-> 33 x 48 patches, grid (1, 11, 16), 176 tokens, ``pixel_values`` [1, 2520, 768].

Pixels leave the workers as 8-bit values (``pixel_kwargs`` = `RAW_PIXELS`: the processor
resizes in 8 bits, then rescales; with that off its patch rows are the resized image's bytes).
``pixel_rows`` declares the rows for `train.pixels`: channel last within a 16 x 16 x 3 row,
padding rows where ``image_position_ids`` is -1 (0.0 in the processor's floats).

Attention: with ``use_bidirectional_attention: "vision"`` the model attends both ways inside each
image's run of soft tokens on its *sliding* layers only (``create_masks_for_vision_model``:
full layers causal), which `train.block_attention` applies per sample (``image_attention``,
the rule's layers from the model config). Positions are 1-D and restart per sample.

Video (with torchvision, which ``Gemma4VideoProcessor`` needs): the stored frames, decoded with
PyAV, go through the video processor with ``do_sample_frames=False`` (the counter sampled
them): ``pixel_values_videos`` [n, max_patches, 768] and ``video_position_ids`` [n, max_patches,
2] (frames padded like images, at the video budget: 70 x 9 patches), ``num_frames_per_video``
[1] = n, all joined ``cat``; the model splits the frames back per video by the counts. Each
frame's run of ``<|video|>`` soft tokens is its own bidirectional block on the sliding layers
(``video_attention``: the model's ``get_block_sequence_ids_for_mask`` groups maximal runs of
image *or* video tokens, and ``<image|>`` timestamp ``<|image>`` separates the frames), never
one block over the whole video. Plan: grid (n, rows, cols), ``num_tokens`` n x rows x cols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from families.gemma4.counter import VIDEO_TOKEN
from families.gemma4.settings import Gemma4Settings
from families.layout import IMAGE, RAW_PIXELS, VIDEO, DecodedVideo, ItemInputs, Join, PatchRows, Rope, SampleInputs
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4Layout:
    """Padded patch sequences of every image of a row stacked in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {
        "pixel_values": "cat",
        "image_position_ids": "cat",
        "pixel_values_videos": "cat",
        "video_position_ids": "cat",
        "num_frames_per_video": "cat",
    }
    rope: ClassVar[Rope] = "text"
    #: image blocks attended both ways (on sliding layers; the counter records the same)
    image_attention: ClassVar[str] = "bidirectional"
    #: and each video frame's run of soft tokens, one block per frame (module docstring)
    video_attention: ClassVar[str] = "bidirectional"

    settings: Gemma4Settings  # shared with the counter
    image_processor: Any
    images_kwargs: dict[str, Any]  # the processor call's image kwargs, plus tensors out
    image_token_id: int  # <|image|>: the model's config.image_token_id
    pixel_rows: PatchRows  # how pixel_values hold patches (module docstring)
    video_token_id: int  # <|video|>: the model's config.video_token_id
    video_processor: Any | None  # None where torchvision is missing
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Gemma4Layout:
        """From the loaded processor."""
        settings = Gemma4Settings.from_processor(bundle)
        processor = bundle.processor
        return cls(
            settings=settings,
            image_processor=bundle.image_processor,
            images_kwargs={**settings.images_kwargs, "return_tensors": "pt"},
            image_token_id=bundle.token_id("<|image|>", "image_token"),
            pixel_rows=PatchRows(
                patch_size=settings.patch_size,
                channel_order="last",
                padding_keyword="image_position_ids",
                padding_value=-1,
            ),
            video_token_id=bundle.token_id(VIDEO_TOKEN, "video_token"),
            video_processor=getattr(processor, "video_processor", None) if processor is not None else None,
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        """Image, and video where the video processor is loaded (torchvision): no video trains without it."""
        if self.video_processor is None:
            return {IMAGE: self.image_token_id}
        return {IMAGE: self.image_token_id, VIDEO: self.video_token_id}

    @property
    def supports_video(self) -> bool:
        return self.video_processor is not None

    @property
    def missing_video_package(self) -> str | None:
        """The package whose absence leaves no video processor (`train.media` exits 3 naming it)."""
        return None if self.video_processor is not None else "torchvision"

    def _grid(self, positions: torch.Tensor, tokens: int, what: str) -> tuple[int, int]:
        """(rows, cols) of soft tokens from one padded patch sequence's positions [P, 2]."""
        real = (positions >= 0).all(dim=-1)
        cols = int(positions[real, 0].max()) + 1
        rows = int(positions[real, 1].max()) + 1
        k = self.settings.pooling_kernel_size
        if rows % k or cols % k or (rows // k) * (cols // k) != tokens or int(real.sum()) != rows * cols:
            raise ValueError(f"the {what} processor made a {rows} x {cols} patch grid for {tokens} soft tokens")
        return rows // k, cols // k

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([image], **{**self.images_kwargs, **self.pixel_kwargs})
        positions = got["image_position_ids"]
        tokens = int(got["num_soft_tokens_per_image"][0])
        rows, cols = self._grid(positions[0], tokens, "image")
        k2 = self.settings.pooling_kernel_size**2
        return ItemInputs(
            tensors={"pixel_values": got["pixel_values"], "image_position_ids": positions},
            grid_thw=(1, rows, cols),
            num_tiles=1,
            num_tokens=tokens,
            num_patches=tokens * k2,
        )

    def _video(self, video: DecodedVideo) -> ItemInputs:
        if self.video_processor is None:
            raise TypeError("no video processor (train.media checks supports_video first)")
        got = self.video_processor(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
        positions = got["video_position_ids"]
        frames = int(positions.shape[0])
        per_frame = int(got["num_soft_tokens_per_video"][0])
        grids = {self._grid(positions[f], per_frame, "video") for f in range(frames)}
        if len(grids) != 1 or frames != len(video.frames):
            raise ValueError(f"the video processor made {frames} frames, grids {sorted(grids)}, of {len(video.frames)}")
        rows, cols = grids.pop()
        return ItemInputs(
            tensors={
                "pixel_values_videos": got["pixel_values_videos"],
                "video_position_ids": positions,
                "num_frames_per_video": torch.tensor([frames], dtype=torch.int64),
            },
            grid_thw=(frames, rows, cols),
            num_tiles=1,
            num_tokens=frames * per_frame,
            num_patches=frames * per_frame * self.settings.pooling_kernel_size**2,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        return SampleInputs(items=(*(self._item(image) for image in images), *(self._video(v) for v in videos)))
