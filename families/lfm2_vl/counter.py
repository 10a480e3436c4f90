"""LFM2-VL (``Lfm2VlProcessor`` + ``Lfm2VlImageProcessor``): smart resize, or 512 px tiles.

Image (transformers 5.24, ``models/lfm2_vl/image_processing_lfm2_vl.py``, on the EXIF-oriented
source size h x w; p = ``encoder_patch_size``, d = ``downsample_factor``, F = p * d):

1. ``smart_resize``: sides rounded to F (at least F); above ``max_image_tokens * F^2`` pixels
   scaled down by beta = sqrt(h w / max) and floored to F, below ``min_image_tokens * F^2``
   scaled up and ceiled to F. This is the unsplit image's (or the thumbnail's) size.
2. ``_is_image_too_large``: sides rounded to F (at least p) hold more than
   ``max_image_tokens * F^2 * max_pixels_tolerance`` pixels. A large image with splitting on
   (``min_tiles``/``max_tiles`` not both 1) is resized to the (cols, rows) grid of
   ``find_closest_aspect_ratio`` (grids with min_tiles <= cols*rows <= max_tiles, ordered as
   the processor orders them; a tie goes to the later grid when w*h > 0.5 * tile^2 * cols*rows)
   and cut into cols*rows ``tile_size`` tiles, plus the step-1 thumbnail when ``use_thumbnail``.
3. Tokens (``Lfm2VlProcessor._build_image_tokens``): ``<|image_start|>``, then per tile
   ``<|img_row_R_col_C|>`` + ``<image>`` x ceil(tile/p/d)^2, then ``<|img_thumbnail|>`` +
   ``<image>`` x (h'/F)(w'/F) for the thumbnail, then ``<|image_end|>``; an unsplit image is
   ``<image>`` x (h'/F)(w'/F) between start and end. Without ``use_image_special_tokens`` only
   the ``<image>`` runs. All are added tokens, so the expansion is spliced in ids.

Refused per image (error rows, never estimated): an encoder input of more patches than
``_preprocess`` pads to (extreme aspect ratios: the processor's pixel mask then disagrees with
its pixels, so no model can take it), and a 1 x 1 grid in the split path (``min_tiles`` 1: the
processor writes the thumbnail's count for a 512 px tile). Video: the processor takes none.

Example (LFM2-VL-450M settings): 1024x768 -> large (1024*768 > 256*32^2*2), grid 3 cols x 2
rows, 6 x 256 ``<image>`` + 6 position tokens + start/end = 1544 ids; grid (1, 2, 3), 6 tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from families.counter import MediaCount, MediaRejected
from families.lfm2_vl.settings import Lfm2VlSettings
from families.processor import ProcessorBundle, ProcessorLoadError
from packvlm.sample_error import SampleError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from schemas.reasons import Reason


@lru_cache(maxsize=16)
def target_ratios(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """``Lfm2VlImageProcessor._target_ratios``: (cols, rows), the same set sorted (stably) by area."""
    ratios = [
        (w, h)
        for n in range(min_tiles, max_tiles + 1)
        for w in range(1, n + 1)
        for h in range(1, n + 1)
        if min_tiles <= w * h <= max_tiles
    ]
    return tuple(sorted(set(ratios), key=lambda x: x[0] * x[1]))


def closest_grid(width: int, height: int, *, tile_size: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """``find_closest_aspect_ratio``: the (cols, rows) grid a large image is tiled into."""
    aspect = width / height
    best_diff, best = float("inf"), (1, 1)
    area = width * height
    for cols, rows in target_ratios(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * (tile_size * tile_size * cols * rows):
            best = (cols, rows)
    return best


def smart_resize(height: int, width: int, s: Lfm2VlSettings) -> tuple[int, int]:
    """``Lfm2VlImageProcessor.smart_resize``: (height, width) of the unsplit image or the thumbnail."""
    factor = s.encoder_patch_size * s.downsample_factor
    min_pixels = s.min_image_tokens * s.encoder_patch_size**2 * s.downsample_factor**2
    max_pixels = s.max_image_tokens * s.encoder_patch_size**2 * s.downsample_factor**2
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def is_too_large(height: int, width: int, s: Lfm2VlSettings) -> bool:
    """``_is_image_too_large`` (its floor is the patch, not the factor)."""
    factor = s.encoder_patch_size * s.downsample_factor
    h_bar = max(s.encoder_patch_size, round(height / factor) * factor)
    w_bar = max(s.encoder_patch_size, round(width / factor) * factor)
    return (
        h_bar * w_bar > s.max_image_tokens * s.encoder_patch_size**2 * s.downsample_factor**2 * s.max_pixels_tolerance
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ImagePlan:
    """What the processor makes of one image: its grid, its thumbnail / unsplit size, its tokens."""

    rows: int  # 1 x 1: unsplit
    cols: int
    resized: tuple[int, int]  # (height, width): the unsplit image, or the thumbnail
    thumbnail: bool
    tokens_per_tile: int
    resized_tokens: int  # tokens of the unsplit image or the thumbnail

    @property
    def split(self) -> bool:
        return self.rows * self.cols > 1

    @property
    def num_tiles(self) -> int:
        """Encoder inputs: the tiles plus the thumbnail, or the one unsplit image."""
        return self.rows * self.cols + int(self.thumbnail) if self.split else 1

    @property
    def num_tokens(self) -> int:
        if not self.split:
            return self.resized_tokens
        return self.rows * self.cols * self.tokens_per_tile + (self.resized_tokens if self.thumbnail else 0)


def plan_image(width: int, height: int, s: Lfm2VlSettings) -> ImagePlan:
    """The processor's plan for a width x height image; MediaRejected where it cannot be trained on."""
    if width <= 0 or height <= 0:
        raise MediaRejected(f"image of size {width}x{height}")
    p, d = s.encoder_patch_size, s.downsample_factor
    new_h, new_w = smart_resize(height, width, s)
    resized_patches = (new_h // p) * (new_w // p)
    rows = cols = 1
    if is_too_large(height, width, s) and s.splitting:
        cols, rows = closest_grid(width, height, tile_size=s.tile_size, min_tiles=s.min_tiles, max_tiles=s.max_tiles)
        if rows * cols == 1:
            raise MediaRejected(
                f"{width}x{height}: LFM2-VL's processor tiles it as one {s.tile_size} px tile (min_tiles 1) but writes "
                "the token count of its thumbnail size: pixels and text disagree; set min_tiles >= 2"
            )
    thumbnail = rows * cols > 1 and s.use_thumbnail
    if (rows * cols == 1 or thumbnail) and resized_patches > s.max_num_patches:
        raise MediaRejected(
            f"{width}x{height}: LFM2-VL's processor resizes it to {new_w}x{new_h}, {resized_patches} patches, more "
            f"than the {s.max_num_patches} it pads to (its pixel mask and pixels disagree); crop the image to a "
            "less extreme aspect ratio"
        )
    return ImagePlan(
        rows=rows,
        cols=cols,
        resized=(new_h, new_w),
        thumbnail=thumbnail,
        tokens_per_tile=s.tokens_per_tile,
        resized_tokens=math.ceil((new_h // p) / d) * math.ceil((new_w // p) / d),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm2VlCounter:
    settings: Lfm2VlSettings  # shared with the layout
    processor_class: str

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Lfm2VlCounter:
        name = type(bundle.image_processor).__name__
        if name not in ("Lfm2VlImageProcessor", "SettingsOnlyImageProcessor"):
            raise ProcessorLoadError(
                f"{bundle.source}: Lfm2VlProcessor with {name}; the closed form knows only Lfm2VlImageProcessor"
            )
        return cls(settings=Lfm2VlSettings.from_processor(bundle), processor_class=bundle.processor_class)

    @property
    def image_token_id(self) -> int:
        """``<image>``: the template's placeholder and the per-embedding token."""
        return self.settings.image_token_id

    @property
    def video_token_id(self) -> int:
        return -1  # no video token: the processor takes no video

    def expansion(self, plan: ImagePlan) -> tuple[int, ...]:
        """``_build_image_tokens`` in ids."""
        s = self.settings
        special = s.use_image_special_tokens
        image = s.image_token_id
        parts: list[int] = [s.image_start_id] if special else []
        if plan.split:
            for row in range(1, plan.rows + 1):
                for col in range(1, plan.cols + 1):
                    if special:
                        parts.append(s.position_ids[(row, col)])
                    parts.extend([image] * plan.tokens_per_tile)
            if plan.thumbnail:
                if special:
                    parts.append(s.thumbnail_id)
                parts.extend([image] * plan.resized_tokens)
        else:
            parts.extend([image] * plan.resized_tokens)
        if special:
            parts.append(s.image_end_id)
        return tuple(parts)

    def count_image(self, width: int, height: int) -> MediaCount:
        plan = plan_image(width, height, self.settings)
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=plan.rows,
            grid_w=plan.cols,
            num_tokens=plan.num_tokens,
            expansion=self.expansion(plan),
            num_tiles=plan.num_tiles,
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise SampleError(
            Reason.UNSUPPORTED_MEDIA,
            f"{self.processor_class} takes images only; this sample has a video (drop it or use a video model)",
        )

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        return {}
