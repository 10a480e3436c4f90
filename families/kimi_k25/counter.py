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

Video (chunks of 4 frames with ``HH:MM:SS.fff`` timestamps) is not counted yet: a video is an
``unsupported_media`` error row, never an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.counter import NO_VIDEO_TOKEN, MediaCount
from families.kimi_k25.settings import KimiK25Settings
from families.processor import ProcessorBundle
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


def navit_padded_size(height: int, width: int, settings: KimiK25Settings) -> tuple[int, int]:
    """(H, W) the image is padded to after the resize (module docstring, steps 1-3)."""
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
    video_token_id: int = NO_VIDEO_TOKEN

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> KimiK25Counter:
        return cls(settings=KimiK25Settings.from_processor(bundle), processor_class=bundle.processor_class)

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

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

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"{self.processor_class}: packvlm counts and trains Kimi K2.5 images only; drop the video from this sample",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
