"""Qwen2-VL and Qwen2.5-VL: ``smart_resize`` with factor patch x merge (28).

Image: grid (1, hb/14, wb/14), tokens = hb*wb / 28^2, placeholder ``<|image_pad|>`` x tokens.
Video: frames sampled as ``Qwen2VLVideoProcessor.sample_frames`` does (only when sampling is
requested), every frame resized with the video pixel limits, grid_t = ceil(n / 2), tokens =
grid_t * (hb/28) * (wb/28). Qwen2.5-VL differs only in ``second_per_grid_ts``, which does not
touch the text. Every setting is read from the loaded processor once (`families.qwen2_vl.settings`),
never from class defaults, except where the video processor could not be loaded and its config file
omits a key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from families.counter import IdsFromSettings, MediaCount, MediaRejected
from families.processor import ProcessorBundle
from families.qwen2_vl.settings import Qwen2VLSettings
from families.settings import GridSettings
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


def resize_grid(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's ``smart_resize``; its ValueError (aspect ratio > 200) becomes MediaRejected."""
    try:
        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:
        raise MediaRejected(str(exc)) from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class GridCounter(IdsFromSettings):
    """What the patch-grid counters share: their settings (shared with the layout) and the image count.

    ``resized`` is the Qwen-VL rule; a family whose image processor resizes otherwise (GLM) overrides it.
    """

    settings: GridSettings

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes to: ``smart_resize`` with factor patch x merge."""
        s = self.settings
        return resize_grid(height, width, s.patch_size * s.merge_size, s.min_pixels, s.max_pixels)

    def count_image(self, width: int, height: int) -> MediaCount:
        """Grid (1, hb/patch, wb/patch) and that many / merge^2 ``image_token_id`` placeholders."""
        hb, wb = self.resized(width, height)
        gh, gw = hb // self.settings.patch_size, wb // self.settings.patch_size
        n = gh * gw // self.settings.merge_size**2
        return MediaCount(
            kind="image", grid_t=1, grid_h=gh, grid_w=gw, num_tokens=n, expansion=(self.image_token_id,) * n
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """The processor samples frames at the dataset's fps (its one sampling option here)."""
        return {} if sampling.fps is None else {"fps": sampling.fps, "do_sample_frames": True}


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen2VLCounter(GridCounter):
    settings: Qwen2VLSettings

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Qwen2VLCounter:
        return cls(settings=Qwen2VLSettings.from_processor(bundle))

    def sample_frames(self, meta: VideoMeta, sampling: VideoSampling) -> list[int]:
        """``Qwen2VLVideoProcessor.sample_frames``, float32 torch arithmetic included."""
        v = self.settings.video
        fps = sampling.fps if sampling.fps is not None else (v.fps if v.do_sample_frames else None)
        total = meta.num_frames
        if fps is None:
            return list(range(total))
        tps = v.temporal_patch_size
        min_frames = sampling.min_frames if sampling.min_frames is not None else v.min_frames
        max_frames = sampling.max_frames if sampling.max_frames is not None else v.max_frames
        max_frames = math.floor(min(max_frames, total) / tps) * tps
        n = total / meta.fps * fps
        n = min(max(n, min_frames), max_frames, total)
        n = math.floor(n / tps) * tps
        if n <= 0 or n > total:
            raise MediaRejected(f"video of {total} frames cannot be sampled to {n} frames")
        return torch.arange(0, total, total / n).int().tolist()

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        v = self.settings.video
        indices = self.sample_frames(meta, sampling)
        n = len(indices)
        factor = v.patch_size * v.merge_size
        max_pixels = v.max_pixels
        if v.cap_pixels_per_frame:
            total_pixels = int(v.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * 2 // n), int(v.min_pixels * 1.05))
        hb, wb = resize_grid(meta.height, meta.width, factor, v.min_pixels, max_pixels)
        gt = -(-n // v.temporal_patch_size)
        gh, gw = hb // v.patch_size, wb // v.patch_size
        tokens = gt * gh * gw // v.merge_size**2
        return MediaCount(
            kind="video",
            grid_t=gt,
            grid_h=gh,
            grid_w=gw,
            num_tokens=tokens,
            expansion=(self.video_token_id,) * tokens,
            frame_indices=tuple(indices),
            timestamps=tuple(i / meta.fps for i in indices),
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        if sampling.fps is None:
            return {}
        out: dict[str, Any] = {"fps": sampling.fps, "do_sample_frames": True}
        if sampling.min_frames is not None:
            out["min_frames"] = sampling.min_frames
        if sampling.max_frames is not None:
            out["max_frames"] = sampling.max_frames
        return out
