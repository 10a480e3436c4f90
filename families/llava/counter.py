"""LLaVA-NeXT (``LlavaNextProcessor``) and LLaVA-OneVision (``LlavaOnevisionProcessor``): anyres.

Image (transformers 5.23), with (h, w) the image's size after EXIF transposition:

1. ``image_processing_utils.select_best_resolution``: over ``image_grid_pinpoints`` (H, W),
   the one that maximises the effective resolution ``min(int(w*s) * int(h*s), w*h)``,
   s = min(W/w, H/h), ties to the least wasted area ``W*H - effective`` (first one wins).
2. ``image_processing_pil_llava_{next,onevision}.get_image_patches``: the image is resized
   and padded to (H, W) and cut by ``divide_to_patches`` into ceil(H/P) x ceil(W/P) tiles of
   P = ``crop_size.height`` (else ``size.height``, else ``size.shortest_edge``), after a
   whole-image tile: ``num_tiles`` = 1 + rows x cols (``pixel_values``' patch dimension).
   Each tile is then resized to ``size`` and, with ``do_center_crop``, cropped to
   ``crop_size``: (th, tw), the tile size the processor reads back from ``pixel_values``.
3. ``processing_llava_{next,onevision}._get_number_of_features``: scale = (H // th, W // tw);
   feature grid (ph, pw) = (th // patch_size, tw // patch_size) for NeXT, sqrt(num_image_tokens)
   for OneVision. ``_get_unpadded_features``: (ch, cw) = (ph * scale_h, pw * scale_w); the
   side the image does not fill loses its padding ``(c - int(round(side * c' / side', 7))) // 2``
   twice; features ch * cw plus ch newlines. OneVision only (``vision_aspect_ratio``
   "anyres_max_N"): r = sqrt(ch * cw / (N * ph^2)); if r > 1.1 the grid shrinks to
   int(ch // r) x int(cw // r) (+ int(ch // r) newlines). Base features: ph * pw +
   ``num_additional_image_tokens`` (NeXT), ``num_image_tokens`` (OneVision).
4. ``replace_image_token``: ``<image>`` x total, minus 1 when
   ``vision_feature_select_strategy == "default"``. The templates render ``<image>\\n``;
   ``<image>`` is a special token, so the expansion is spliced in ids.

Nested versus flat image lists: ``LlavaOnevisionImageProcessorPil.preprocess`` tiles an image
only when its batch entry holds exactly one image (``batch_num_images``); an image of a
nested multi-image entry is padded to a square, one tile, ``num_image_tokens + 1`` tokens.
packvlm's processor call (``prep.tokenize.processor_path.run_processor``) passes a sample's
images as a flat list, so every image is tiled, and so is it counted here; the nested rule is
:meth:`LlavaCounter.count_image` with ``multi_image=True``. LLaVA-NeXT has no such rule.

Example (llava-v1.6-mistral-7b-hf: pinpoints 336..1008, tiles 336, patch 14, "default", +1):
800x600 -> (672, 672), 2x2 tiles + 1 = 5; grid 48x48, width fills, height 36:
36*48 + 36 + 577 - 1 = 2340 ``<image>``. OneVision-0.5b (384 grid to 2304, 729 = 27^2, "full"):
800x600 -> (768, 1152), 2x3 + 1 = 7 tiles; grid 54x81 -> 54x73; 3942 + 54 + 729 = 4725.

Video (OneVision only; ``LlavaOnevisionVideoProcessor``): frames = every frame, or with
``do_sample_frames`` and fps f: n = max(1, int(T / fps_src * f)) (> T is rejected), indices
``arange(n) * T // n`` (``video_utils.default_sample_indices_fn``; min/max frames are not
options of that sampler); ``replace_video_token``: ``<video>`` x (n * ceil(sqrt(729) / 2)^2 + 1).
The frame count must be the one the processor's video decoder reports (PyAV here, as the Qwen
counters assume). LLaVA-NeXT takes no video: an ``unsupported_media`` error row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.counter import IdsFromSettings, MediaCount, MediaRejected
from families.llava.settings import LlavaSettings
from families.processor import ProcessorBundle
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """``image_processing_utils.select_best_resolution``: the (H, W) pinpoint the image fills best."""
    best = pinpoints[0]
    max_effective, min_wasted = 0, float("inf")
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_w * pin_h - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best = effective, wasted, (pin_h, pin_w)
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class LlavaCounter(IdsFromSettings):
    settings: LlavaSettings  # shared with the layout

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> LlavaCounter:
        return cls(settings=LlavaSettings.from_processor(bundle))

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of P-tiles the best pinpoint is cut into (the whole-image tile not counted)."""
        pin_h, pin_w = best_resolution(height, width, self.settings.tiles.pinpoints)
        cut = self.settings.tiles.cut
        return -(-pin_h // cut), -(-pin_w // cut)

    def num_tiles(self, width: int, height: int, *, multi_image: bool = False) -> int:
        """``pixel_values``' patch dimension for one image (before batch padding)."""
        if multi_image and self.settings.onevision:
            return 1
        rows, cols = self.tile_grid(width, height)
        return 1 + rows * cols

    def image_tokens(self, width: int, height: int, *, multi_image: bool = False) -> int:
        """``<image>`` ids the processor writes for one image (module docstring, steps 1-4)."""
        if multi_image and self.settings.onevision:
            tokens = self.settings.num_image_tokens + 1
        else:
            pin_h, pin_w = best_resolution(height, width, self.settings.tiles.pinpoints)
            grid_h = self.settings.feature_rows * (pin_h // self.settings.tiles.tile_height)
            grid_w = self.settings.feature_cols * (pin_w // self.settings.tiles.tile_width)
            features, newlines = self._unpadded(height, width, grid_h, grid_w)
            tokens = features + newlines + self.settings.base_features
        return tokens - 1 if self.settings.drop_one else tokens

    def _unpadded(self, height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
        """``_get_unpadded_features`` of either processor."""
        if width / height > grid_w / grid_h:
            grid_h -= (grid_h - int(round(height * (grid_w / width), 7))) // 2 * 2
        else:
            grid_w -= (grid_w - int(round(width * (grid_h / height), 7))) // 2 * 2
        features, newlines = grid_h * grid_w, grid_h
        if self.settings.max_num_patches is not None:
            ratio = math.sqrt(grid_h * grid_w / (self.settings.max_num_patches * self.settings.feature_rows**2))
            if ratio > 1.1:
                features = int(grid_h // ratio) * int(grid_w // ratio)
                newlines = int(grid_h // ratio)
        return features, newlines

    def count_image(self, width: int, height: int, *, multi_image: bool = False) -> MediaCount:
        """One image; ``multi_image``: OneVision's rule for an image of a nested multi-image entry."""
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        n = self.image_tokens(width, height, multi_image=multi_image)
        rows, cols = (1, 1) if multi_image and self.settings.onevision else self.tile_grid(width, height)
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=rows,
            grid_w=cols,
            num_tokens=n,
            expansion=(self.image_token_id,) * n,
            num_tiles=self.num_tiles(width, height, multi_image=multi_image),
        )

    def sample_frames(self, meta: VideoMeta, sampling: VideoSampling) -> list[int]:
        """``video_utils.default_sample_indices_fn`` (OneVision samples only when asked for an fps)."""
        total = meta.num_frames
        if sampling.fps is None:
            return list(range(total))
        n = max(1, int(total / meta.fps * sampling.fps))
        if n > total:
            raise MediaRejected(f"video of {total} frames cannot be sampled to {n} frames at {sampling.fps} fps")
        return [i * total // n for i in range(n)]

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        if not self.settings.onevision:
            raise SampleError(Reason.UNSUPPORTED_MEDIA, "LlavaNextProcessor takes no video")
        indices = self.sample_frames(meta, sampling)
        pooled = math.ceil(int(math.sqrt(self.settings.num_image_tokens)) / 2)
        n = len(indices) * pooled * pooled + 1  # replace_video_token: +1 for the newline
        return MediaCount(
            kind="video",
            grid_t=len(indices),
            grid_h=pooled,
            grid_w=pooled,
            num_tokens=n,
            expansion=(self.video_token_id,) * n,
            num_tiles=len(indices),
            frame_indices=tuple(indices),
            timestamps=tuple(i / meta.fps for i in indices),
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``LlavaOnevisionVideoProcessor`` samples only with ``do_sample_frames``; fps is its one option here."""
        return {} if sampling.fps is None else {"fps": sampling.fps, "do_sample_frames": True}
