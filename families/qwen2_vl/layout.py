"""Patch-grid families: Qwen2-VL, Qwen2.5-VL (and, registered in their modules, Qwen3-VL / Qwen3.5,
GLM-4.xV, Qwen-Omni thinkers).

Their processors flatten each image into ``grid_t * grid_h * grid_w`` patches: ``pixel_values``
[patches, C*t*p*p] and ``image_grid_thw`` [1, 3] per image, concatenated in token order across
the pack (the vision tower splits images by its own cu_seqlens). Videos likewise with
``pixel_values_videos`` / ``video_grid_thw``, plus ``second_per_grid_ts`` where the model's
rope index reads it (Qwen2.5-VL). An item expands to ``prod(grid) / merge_size**2``
placeholder tokens. Positions: the model's own ``get_rope_index`` per sample (mRoPE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, VIDEO, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class GridLayout:
    """Images and videos as flattened patch grids; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {
        "pixel_values": "cat",
        "image_grid_thw": "cat",
        "pixel_values_videos": "cat",
        "video_grid_thw": "cat",
        "second_per_grid_ts": "cat",
    }
    rope: ClassVar[Rope] = "mrope"
    #: the processor's placeholder tokens (the tokenizer attribute is preferred, as the processor does)
    tokens: ClassVar[tuple[str, str]] = ("<|image_pad|>", "<|video_pad|>")

    image_processor: Any
    video_processor: Any | None  # None where torchvision is missing
    image_token_id: int
    video_token_id: int
    merge_size: int
    temporal_patch_size: int
    #: the processor returns ``second_per_grid_ts`` (Qwen2.5-VL) for the model's rope index
    wants_second_per_grid_ts: bool
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> GridLayout:
        """From the loaded processor."""
        processor = bundle.processor
        video = getattr(processor, "video_processor", None) if processor is not None else None
        names = list(getattr(processor, "model_input_names", None) or [])
        tps = getattr(video, "temporal_patch_size", None) or bundle.video_config.get("temporal_patch_size", 2)
        return cls(
            image_processor=bundle.image_processor,
            video_processor=video,
            image_token_id=bundle.token_id(cls.tokens[0], "image_token"),
            video_token_id=bundle.token_id(cls.tokens[1], "video_token"),
            merge_size=int(bundle.image_processor.merge_size),
            temporal_patch_size=int(tps),
            wants_second_per_grid_ts="second_per_grid_ts" in names,
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.image_token_id, VIDEO: self.video_token_id}

    @property
    def supports_video(self) -> bool:
        return self.video_processor is not None

    @property
    def missing_video_package(self) -> str | None:
        """The package whose absence leaves no video processor (`train.media` exits 3 naming it)."""
        return None if self.video_processor is not None else "torchvision"

    @property
    def no_video_reason(self) -> str:
        """What `train.media` says when a video arrives and ``supports_video`` is False."""
        return (
            "the model's video processor could not be loaded (HF video processors need torchvision): "
            "`pip install torchvision` matching your torch, or train on image/text-only data"
        )

    def _item(self, pixels: torch.Tensor, grid: torch.Tensor, prefix: str) -> ItemInputs:
        t, h, w = (int(x) for x in grid.reshape(-1).tolist())
        return ItemInputs(
            tensors={
                f"pixel_values{prefix}": pixels,
                f"{'video' if prefix else 'image'}_grid_thw": grid.to(torch.int64),
            },
            grid_thw=(t, h, w),
            num_tiles=1,
            num_tokens=t * h * w // self.merge_size**2,
            num_patches=t * h * w,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        items = []
        for image in images:
            got = self.image_processor(images=[image], return_tensors="pt", **self.pixel_kwargs)
            items.append(self._item(got["pixel_values"], got["image_grid_thw"], ""))
        for video in videos:
            if self.video_processor is None:
                raise TypeError("no video processor (train.media checks supports_video first)")
            got = self.video_processor(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
            item = self._item(got["pixel_values_videos"], got["video_grid_thw"], "_videos")
            if self.wants_second_per_grid_ts:
                seconds = torch.tensor([self.temporal_patch_size / video.sampled_fps], dtype=torch.float32)
                item.tensors["second_per_grid_ts"] = seconds
            items.append(item)
        return SampleInputs(items=tuple(items))


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen2VLLayout(GridLayout):
    """Qwen2-VL and Qwen2.5-VL (``second_per_grid_ts`` for Qwen2.5-VL videos)."""
