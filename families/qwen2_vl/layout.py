"""Patch-grid families: Qwen2-VL, Qwen2.5-VL (and, registered in their modules, Qwen3-VL / Qwen3.5,
GLM-4.xV, Qwen-Omni thinkers).

Their processors flatten each image into ``grid_t * grid_h * grid_w`` patches: ``pixel_values``
[patches, C*t*p*p] and ``image_grid_thw`` [1, 3] per image, concatenated in token order across
the pack (the vision tower splits images by its own cu_seqlens). Videos likewise with
``pixel_values_videos`` / ``video_grid_thw``, plus ``second_per_grid_ts`` where the model's
rope index reads it (Qwen2.5-VL). An item expands to ``prod(grid) / merge_size**2``
placeholder tokens. Positions: the model's own ``get_rope_index`` per sample (mRoPE).
Placeholder ids, merge size and temporal patch are the family's settings
(`families.settings.GridSettings`, ``settings_class``), the object its counter holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, VIDEO, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle
from families.qwen2_vl.settings import Qwen2VLSettings
from families.settings import GridSettings


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
    settings_class: ClassVar[type[GridSettings]] = GridSettings  # the family's: placeholders, merge size

    settings: GridSettings  # shared with the counter
    image_processor: Any
    video_processor: Any | None  # None where torchvision is missing
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Self:
        """From the loaded processor."""
        processor = bundle.processor
        return cls(
            settings=cls.settings_class.from_processor(bundle),
            image_processor=bundle.image_processor,
            video_processor=getattr(processor, "video_processor", None) if processor is not None else None,
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id, VIDEO: self.settings.video_token_id}

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
            num_tokens=t * h * w // self.settings.merge_size**2,
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
            if self.settings.second_per_grid_ts:
                seconds = torch.tensor([self.settings.temporal_patch_size / video.sampled_fps], dtype=torch.float32)
                item.tensors["second_per_grid_ts"] = seconds
            items.append(item)
        return SampleInputs(items=tuple(items))


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen2VLLayout(GridLayout):
    """Qwen2-VL and Qwen2.5-VL (``second_per_grid_ts`` for Qwen2.5-VL videos)."""

    settings_class: ClassVar[type[GridSettings]] = Qwen2VLSettings
