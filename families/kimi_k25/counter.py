"""Kimi K2.5 VL: MoonViT's NaViT resize (never up), zero padding to 28 px, one token per 2x2 patches.

transformers 5.24 ``image_processing_kimi_k25.navit_resize``, with p = ``patch_size`` (14),
m = ``merge_size`` (2), B = ``max_patches`` (16384) and S = ``size.max_height`` (512 patches):

1. n_h = max(1.0, h // p), n_w = max(1.0, w // p); scale = min(1, sqrt(B / (n_h n_w)),
   S p / h, S p / w) (the float arithmetic is the processor's, so equal bit for bit).
2. h' = min(max(1, int(h scale)), S p), same for w'; the image is resized to h' x w'.
3. Padded to the next multiple of f = p m: H = ceil(h' / f) f, W = ceil(w' / f) f.
4. ``image_grid_thw`` = (1, H / p, W / p); ``Kimi_K25Processor.replace_image_token``:
   (H / p)(W / p) / m^2 ``<|media_pad|>`` tokens, which replace the one the template writes
   inside ``<|media_begin|>image<|media_content|>`` ... ``<|media_end|>``.

Example (Kimi-K2.5, 1920 x 1080): n = 77 x 137 = 10549 < 16384 and 7168 / 1920 > 1, so
scale 1; padded 1092 x 1932 -> grid (1, 78, 138) -> 2691 tokens. A 4000 x 3000 photo:
scale = sqrt(16384 / (214 x 285)) = 0.5183 -> 1554 x 2073 -> 1568 x 2100 -> 4200 tokens.

Video (``Kimi_K25VideoProcessor`` + ``Kimi_K25Processor.replace_video_token``), from the
container's frame count T and rate r (PyAV's ``stream.frames`` / ``average_rate``, what
transformers' PyAV reader puts in ``VideoMetadata``) and the dataset's ``VideoSampling``:

1. Frames: with an fps f, n = max(1, int(T / r * f)) at ``i * T // n`` (``default_sample_indices_fn``;
   n > T raises in the processor: :class:`MediaRejected`); without one, every frame.
   The processor has no min / max frame count: a dataset ``min_frames`` / ``max_frames`` that n
   falls outside of is refused per sample (never sampled otherwise than the processor does).
2. Chunks of ``temporal_patch_size`` (4) frames, the last one shorter; each frame NaViT-resized as
   an image with the *video* budget (``max_patches`` 4096) and padded to 28 px: every chunk has
   ``video_grid_thw`` (frames in it, gh, gw) and costs one frame's gh gw / 4 tokens (the vision
   tower averages a chunk's frames, `families.kimi_k25.layout`).
3. Text per chunk: ``HH:MM:SS.fff`` of its first frame (i / r seconds, ``time.gmtime``, so hours
   wrap at 24) + ``<|media_begin|>video<|media_content|>`` + gh gw / 4
   ``<|kimi_k25_video_placeholder|>`` + ``<|media_end|>``, replacing the template's one
   ``<|kimi_k25_video_placeholder|>``. The timestamp digits are BPE text that merges with the text
   before the video (``"frame 12" + "00:00:00.000"``), so the expansion is spliced as text
   (``MediaCount.expansion_text``) and the conversation tokenized once.

Example (8 frames at 4 fps, 64 x 48, f = 2): n = 4 frames 0, 2, 4, 6; one chunk (4, 4, 6) ->
``00:00:00.000`` + 6 placeholders.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from families.counter import MediaCount, MediaRejected
from families.kimi_k25.settings import KimiK25Settings
from families.processor import ProcessorBundle
from families.run_text import RunText
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


class NavitLimits(Protocol):
    """The resize settings images (`KimiK25Settings`) and video frames (`KimiK25VideoSettings`) share."""

    @property
    def patch_size(self) -> int: ...
    @property
    def max_patches(self) -> int: ...
    @property
    def max_side_patches(self) -> int: ...
    @property
    def factor(self) -> int: ...


def navit_padded_size(height: int, width: int, settings: NavitLimits) -> tuple[int, int]:
    """(H, W) the image or frame is padded to after the resize (module docstring, steps 1-3)."""
    patch, side = settings.patch_size, settings.max_side_patches
    current = max(1.0, height // patch) * max(1.0, width // patch)
    scale = min(1.0, math.sqrt(settings.max_patches / current), (side * patch) / height, (side * patch) / width)
    new_height = min(max(1, int(height * scale)), side * patch)
    new_width = min(max(1, int(width * scale)), side * patch)
    factor = settings.factor
    return -(-new_height // factor) * factor, -(-new_width // factor) * factor


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiK25Counter:
    settings: KimiK25Settings  # shared with the layout
    processor_class: str
    video_token: str  # the placeholder's text, repeated in each chunk's expansion text

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> KimiK25Counter:
        settings = KimiK25Settings.from_processor(bundle)
        return cls(
            settings=settings,
            processor_class=bundle.processor_class,
            video_token=bundle.tokenizer.convert_ids_to_tokens(settings.video_token_id),
        )

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.settings.video_token_id

    def count_image(self, width: int, height: int) -> MediaCount:
        padded_height, padded_width = navit_padded_size(height, width, self.settings)
        grid_h, grid_w = padded_height // self.settings.patch_size, padded_width // self.settings.patch_size
        num_tokens = grid_h * grid_w // self.settings.merge_size**2
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=grid_h,
            grid_w=grid_w,
            num_tokens=num_tokens,
            expansion=(self.settings.image_token_id,) * num_tokens,
        )

    def sample_frames(self, meta: VideoMeta, sampling: VideoSampling) -> list[int]:
        """``video_utils.default_sample_indices_fn`` at the dataset's fps (every frame without one)."""
        total = meta.num_frames
        n = total if sampling.fps is None else max(1, int(total / meta.fps * sampling.fps))
        if n > total:
            raise MediaRejected(f"video of {total} frames cannot be sampled to {n} frames at {sampling.fps} fps")
        if (sampling.min_frames is not None and n < sampling.min_frames) or (
            sampling.max_frames is not None and n > sampling.max_frames
        ):
            raise MediaRejected(
                f"{n} frames at fps {sampling.fps}, outside the dataset's min_frames {sampling.min_frames} / "
                f"max_frames {sampling.max_frames}: {self.processor_class} has no frame limits (it samples by fps "
                "only); change the dataset's video fps or limits"
            )
        return [i * total // n for i in range(n)]

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        v = self.settings.video
        indices = self.sample_frames(meta, sampling)
        padded_height, padded_width = navit_padded_size(meta.height, meta.width, v)
        grid_h, grid_w = padded_height // v.patch_size, padded_width // v.patch_size
        per_chunk = grid_h * grid_w // v.merge_size**2
        times = [i / meta.fps for i in indices]
        chunks = range(0, len(indices), v.temporal_patch_size)
        begin, end = "<|media_begin|>video<|media_content|>", "<|media_end|>"
        stamps = [timestamp_text(times[start]) + begin for start in chunks]
        between = [end + stamp for stamp in stamps[1:]]
        literals = (stamps[0], *between, end) if stamps else ("",)
        text = RunText(literals, ((self.video_token, per_chunk),) * len(stamps))
        return MediaCount(
            kind="video",
            grid_t=len(chunks),
            grid_h=grid_h,
            grid_w=grid_w,
            num_tokens=len(chunks) * per_chunk,
            expansion=(),
            expansion_runs=text,
            num_tiles=len(chunks),
            frame_indices=tuple(indices),
            timestamps=tuple(times),
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """The dataset's fps, or every frame: the processor's own default (2 fps) is never left to apply."""
        if sampling.fps is None:
            return {"do_sample_frames": False}
        return {"fps": sampling.fps, "do_sample_frames": True}


def timestamp_text(seconds: float) -> str:
    """``Kimi_K25Processor.replace_video_token``'s ``HH:MM:SS.fff`` (hours wrap at 24, milliseconds truncated)."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"
