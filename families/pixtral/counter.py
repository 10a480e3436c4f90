"""Pixtral, Mistral 3 (Mistral-Small-3.1/3.2) and Ministral 3: rows of ``[IMG]`` ended by breaks.

transformers 5.23 serves all of them with ``PixtralProcessor`` (``processing_auto`` maps
``mistral3`` to it); ``Mistral3Processor`` is registered too in case a later release or a
checkpoint names it. Image, with P = processor ``patch_size`` x ``spatial_merge_size`` (the
processor's ``_process_images`` passes that product to the image processor as its patch):

1. ``image_processing_pil_pixtral.get_resize_output_image_size``: ratio = max(h / max_h,
   w / max_w) (max_h = max_w = ``size["longest_edge"]``); only when ratio > 1, h and w
   become ``floor(h / ratio)``, ``floor(w / ratio)`` (the float division of the source).
2. ``_num_image_tokens``: rows = (h - 1) // P + 1, cols = (w - 1) // P + 1 (ceil); the image
   is resized to (rows * P, cols * P), its ``image_sizes`` entry.
3. ``PixtralProcessor.replace_image_token``: ``([IMG] * cols + [IMG_BREAK]) * rows`` with the
   last token replaced by ``[IMG_END]``: rows * (cols + 1) ids, rows * cols of them vision
   embeddings. A side that floors to 0 gives a 0-pixel resize, which the image processor
   rejects with ValueError: here :class:`MediaRejected`.

Example (pixtral-12b, P = 16, longest edge 1024): 3000 x 16 -> ratio 2.93, 1024 x 5 ->
rows 1, cols 64: 64 ``[IMG]`` + ``[IMG_END]``. Grid (1, rows x merge, cols x merge) counts
vision patches before the spatial merge, as the Qwen counters' grids do.

Videos: the processor takes none; a video becomes an ``unsupported_media`` error row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.counter import NO_VIDEO_TOKEN, MediaCount, MediaRejected
from families.pixtral.settings import PixtralSettings
from families.processor import ProcessorBundle
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


def resized_rows_cols(height: int, width: int, *, patch: int, max_height: int, max_width: int) -> tuple[int, int]:
    """(rows, cols) of P-pixel cells after the Pixtral resize (module docstring, steps 1-2)."""
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height = int(math.floor(height / ratio))
        width = int(math.floor(width / ratio))
    if height <= 0 or width <= 0:
        raise MediaRejected(f"image resizes to {height}x{width} pixels (a side floors to 0); the processor rejects it")
    return (height - 1) // patch + 1, (width - 1) // patch + 1


def _max_size(image_processor: Any) -> tuple[int, int]:
    """(max_h, max_w) as ``PixtralImageProcessorPil.resize`` reads its ``size``."""
    size = image_processor.size
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    longest, height, width = get("longest_edge"), get("height"), get("width")
    if longest:
        return int(longest), int(longest)
    if height and width:
        return int(height), int(width)
    raise ValueError(f"Pixtral image processor size {size!r} has neither longest_edge nor height and width")


@dataclass(frozen=True, kw_only=True, slots=True)
class PixtralCounter:
    settings: PixtralSettings  # shared with the layout
    image_break_id: int
    image_end_id: int
    max_height: int
    max_width: int
    processor_class: str
    video_token_id: int = NO_VIDEO_TOKEN

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> PixtralCounter:
        settings = PixtralSettings.from_processor(bundle)
        max_height, max_width = _max_size(bundle.image_processor)
        return cls(
            settings=settings,
            image_break_id=settings.token_id(bundle, "image_break_token"),
            image_end_id=settings.token_id(bundle, "image_end_token"),
            max_height=max_height,
            max_width=max_width,
            processor_class=bundle.processor_class,
        )

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    def count_image(self, width: int, height: int) -> MediaCount:
        rows, cols = resized_rows_cols(
            height,
            width,
            patch=self.settings.patch_size * self.settings.merge_size,
            max_height=self.max_height,
            max_width=self.max_width,
        )
        row = (self.settings.image_token_id,) * cols + (self.image_break_id,)
        expansion = row * (rows - 1) + row[:-1] + (self.image_end_id,)
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=rows * self.settings.merge_size,
            grid_w=cols * self.settings.merge_size,
            num_tokens=rows * cols,
            expansion=expansion,
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"{self.processor_class} takes images only; this sample has a video (drop it or use a video model)",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
