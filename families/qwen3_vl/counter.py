"""Qwen3-VL (and Qwen3.5-VL): patch 16, factor 32, timestamped video placeholders.

Image: as Qwen2-VL with factor 32. Video: ``Qwen3VLVideoProcessor.sample_frames`` picks
n = int(T / fps_src * fps) frames clamped to [min_frames, min(max_frames, T)] at
round(linspace(0, T-1, n)); the whole clip is resized once with *total* pixel limits
(t x h x w); each temporal pair of frames becomes ``"<{t:.1f} seconds>"`` +
``<|vision_start|>`` + S x ``<|video_pad|>`` + ``<|vision_end|>``, where t averages the pair's
timestamps. The timestamp strings are ordinary text and are tokenized here; they sit between
special tokens, so tokenizing them alone gives the ids the processor's single pass gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_smart_resize

from families.counter import MediaCount, MediaRejected
from families.processor import ProcessorBundle
from families.qwen2_vl.counter import GridCounter
from families.qwen3_vl.settings import Qwen3VLSettings
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3VLCounter(GridCounter):
    settings: Qwen3VLSettings
    vision_start_id: int  # the timestamped video expansion's own delimiters
    vision_end_id: int
    tokenizer: Any  # tokenizes the timestamp text

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Qwen3VLCounter:
        return cls(
            settings=Qwen3VLSettings.from_processor(bundle),
            vision_start_id=bundle.token_id("<|vision_start|>", "vision_start_token"),
            vision_end_id=bundle.token_id("<|vision_end|>", "vision_end_token"),
            tokenizer=bundle.tokenizer,
        )

    def sample_frames(self, meta: VideoMeta, sampling: VideoSampling) -> list[int]:
        """``Qwen3VLVideoProcessor.sample_frames`` (min/max frames from the dataset config win)."""
        v = self.settings.video
        total = meta.num_frames
        min_frames = sampling.min_frames if sampling.min_frames is not None else v.min_frames
        max_frames = sampling.max_frames if sampling.max_frames is not None else v.max_frames
        fps = sampling.fps if sampling.fps is not None else (v.fps if v.do_sample_frames else None)
        if fps is None and sampling.fps is None and not v.do_sample_frames:
            return list(range(total))
        if fps is not None:
            n = int(total / meta.fps * fps)
            n = min(max(n, min_frames), max_frames, total)
        else:
            n = min(max(total, min_frames), max_frames)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def timestamps(self, indices: list[int], source_fps: float) -> list[float]:
        """``Qwen3VLProcessor._calculate_timestamps``: mean time of each temporal patch."""
        tps = self.settings.video.temporal_patch_size
        padded = list(indices)
        if len(padded) % tps:
            padded.extend([padded[-1]] * (tps - len(padded) % tps))
        times = [i / source_fps for i in padded]
        return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        v = self.settings.video
        indices = self.sample_frames(meta, sampling)
        n = len(indices)
        factor = v.patch_size * v.merge_size
        max_pixels = v.max_pixels
        if v.cap_pixels_per_frame:
            per_frame = max(min(v.max_video_tokens * factor * factor, v.max_pixels // n), int(v.min_pixels * 1.05))
            max_pixels = per_frame * n
        try:
            hb, wb = video_smart_resize(
                num_frames=n,
                height=meta.height,
                width=meta.width,
                temporal_factor=v.temporal_patch_size,
                factor=factor,
                min_pixels=v.min_pixels,
                max_pixels=max_pixels,
            )
        except ValueError as exc:
            raise MediaRejected(str(exc)) from exc
        gt = -(-n // v.temporal_patch_size)
        gh, gw = hb // v.patch_size, wb // v.patch_size
        per_frame_tokens = gh * gw // v.merge_size**2
        times = self.timestamps(indices, meta.fps)
        stamp_ids = self.tokenizer([f"<{t:.1f} seconds>" for t in times], add_special_tokens=False)["input_ids"]
        expansion: list[int] = []
        for ids in stamp_ids:
            expansion.extend(ids)
            expansion.append(self.vision_start_id)
            expansion.extend([self.video_token_id] * per_frame_tokens)
            expansion.append(self.vision_end_id)
        return MediaCount(
            kind="video",
            grid_t=gt,
            grid_h=gh,
            grid_w=gw,
            num_tokens=gt * per_frame_tokens,
            expansion=tuple(expansion),
            frame_indices=tuple(indices),
            timestamps=tuple(times),
        )
