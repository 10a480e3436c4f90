"""PaddleOCR-VL: images as patch grids, positions from the model's own 3-D ``get_rope_index`` per sample.

``PaddleOCRVLImageProcessorPil`` gives per image ``pixel_values`` [hb/14 * wb/14, 3, 14, 14]
(one 14x14 patch per row, image-shaped, not flattened as Qwen's) and ``image_grid_thw``
[1, 3]; both concatenate in token order across the pack. The model splits them back per image
everywhere it mixes patches: the vision encoder's attention runs on ``cu_seqlens`` from the
grids (flash) or per image chunk (sdpa / eager), its learned position grid is interpolated per
image, and the projector merges 2x2 patches per image. The ERNIE-4.5 decoder is plain causal
attention (no sliding window, no state across tokens), so a packed row needs only the
document mask and per-sample positions: ``rope = "mrope"`` gives position_ids [4, 1, T] (row 0
the text positions restarting per sample, rows 1-3 ``get_rope_index`` of each sample alone),
which ``PaddleOCRTextModel`` splits as Qwen2-VL's does. The processor takes no video.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.paddleocr_vl.settings import PaddleOCRVLSettings
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddleOCRVLLayout:
    """Patch grids joined by concatenation; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat", "image_grid_thw": "cat"}
    rope: ClassVar[Rope] = "mrope"
    supports_video: ClassVar[bool] = False
    no_video_reason: ClassVar[str] = "PaddleOCRVLProcessor takes images only: drop the video or use a video model"

    settings: PaddleOCRVLSettings  # shared with the counter
    image_processor: Any
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> PaddleOCRVLLayout:
        """From the loaded processor."""
        return cls(settings=PaddleOCRVLSettings.from_processor(bundle), image_processor=bundle.image_processor)

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor(images=[image], return_tensors="pt", **self.pixel_kwargs)
        grid = got["image_grid_thw"].to(torch.int64).reshape(1, 3)
        t, h, w = (int(x) for x in grid[0].tolist())
        return ItemInputs(
            tensors={"pixel_values": got["pixel_values"], "image_grid_thw": grid},
            grid_thw=(t, h, w),
            num_tiles=1,
            num_tokens=t * h * w // self.settings.merge_size**2,
            num_patches=t * h * w,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("PaddleOCR-VL takes no video (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
