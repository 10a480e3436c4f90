"""PaddleOCR-VL: its own ``smart_resize`` with factor patch x merge (28), one placeholder per merged patch.

Image (transformers 5.24, ``models/paddleocr_vl/image_processing_pil_paddleocr_vl.py``):
``PaddleOCRVLImageProcessorPil.resize`` calls that module's ``smart_resize`` with
``factor = patch_size * merge_size`` and ``size.shortest_edge`` / ``size.longest_edge`` as min /
max pixels. Unlike Qwen2-VL's, it first scales a side below 28 up to 28, the other side
``round(other * 28 / side)`` (height first, then width); then it rejects an aspect ratio > 200
(ValueError: :class:`MediaRejected`, an error row), rounds both sides to multiples of 28 and,
over max_pixels, floors them by ``beta = sqrt(h*w / max_pixels)``, under min_pixels ceils
them by ``beta = sqrt(min_pixels / (h*w))``. ``patchify`` gives grid (1, hb/14, wb/14)
(temporal patch 1); ``PaddleOCRVLProcessor.replace_image_token`` writes
``<|IMAGE_PLACEHOLDER|>`` x (grid product / merge^2). The chat template wraps each image in
``<|IMAGE_START|>`` ... ``<|IMAGE_END|>`` (special tokens), so the expansion is spliced in ids.

Example (PaddlePaddle/PaddleOCR-VL, 147384..2822400 px): 300 x 40 (w x h) -> 308 x 28 is
under min_pixels -> beta = sqrt(147384 / 12000) -> 1064 x 168 -> grid (1, 12, 76), 228 tokens;
1 x 1 -> 28 x 28 -> under min -> 392 x 392 -> grid (1, 28, 28), 196 tokens.

Videos: ``PaddleOCRVLProcessor`` takes none; a video becomes an ``unsupported_media`` error row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import smart_resize

from families.counter import NO_VIDEO_TOKEN, MediaCount, MediaRejected
from families.paddleocr_vl.settings import PaddleOCRVLSettings
from families.processor import ProcessorBundle
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddleOCRVLCounter:
    settings: PaddleOCRVLSettings  # shared with the layout
    processor_class: str
    video_token_id: int = NO_VIDEO_TOKEN

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> PaddleOCRVLCounter:
        return cls(settings=PaddleOCRVLSettings.from_processor(bundle), processor_class=bundle.processor_class)

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes to; its ValueError becomes MediaRejected."""
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        s = self.settings
        try:
            return smart_resize(
                height, width, factor=s.patch_size * s.merge_size, min_pixels=s.min_pixels, max_pixels=s.max_pixels
            )
        except ValueError as exc:
            raise MediaRejected(str(exc)) from exc

    def count_image(self, width: int, height: int) -> MediaCount:
        hb, wb = self.resized(width, height)
        s = self.settings
        gh, gw = hb // s.patch_size, wb // s.patch_size
        n = gh * gw // s.merge_size**2
        return MediaCount(kind="image", grid_t=1, grid_h=gh, grid_w=gw, num_tokens=n, expansion=(s.image_token_id,) * n)

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"{self.processor_class} takes images only; this sample has a video (drop it or use a video model)",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
