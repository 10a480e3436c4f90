"""MiniCPM-V 4.6 (``MiniCPMV4_6Processor`` + ``MiniCPMV4_6ImageProcessorPil``): a source image plus slices.

Image (transformers 5.24, ``models/minicpmv4_6/image_processing_pil_minicpmv4_6.py``), with S =
``scale_resolution`` (448), P = ``patch_size`` (14), m = 4 in "16x" mode (2 in "4x"):

- grid: ``get_sliced_grid``: multiple = min(ceil(w*h / S^2), max_slice_nums); none when it is
  <= 1 (or ``slice_mode`` is off); else of the (rows, cols) with rows*cols in {multiple-1,
  multiple, multiple+1} (1 and > max excluded) the one whose log(cols/rows) is closest to
  log(w/h), ties to more rows.
- source image: ``find_best_resize`` (upscaling allowed only without a grid): past S^2 pixels
  (or when upscaling) h' = int(S / sqrt(w/h)), w' = int(h' * w/h); each side then rounded to a
  multiple of P*m (at least P*m): (h'/P)(w'/P)/m^2 tokens.
- slices: ``get_refine_size``: each side rounded to a multiple of the grid (at least the grid),
  the per-slice size passed through ``find_best_resize`` with upscaling: every slice has the
  same (hs/P)(ws/P)/m^2 tokens.

``MiniCPMV4_6Processor.replace_image_token`` writes ``<image>`` + n0 x ``<|image_pad|>`` +
``</image>``, then per grid row ``cols`` x (``<slice>`` + ns x ``<|image_pad|>`` + ``</slice>``),
rows joined by ``\\n``; with ``use_image_id`` (default) ``_prepend_local_ids`` puts
``<image_id>k</image_id>`` first, k the image's place among the sample's images (0, 1, ...).
Every piece of text in the expansion (the digits of k, the row ``\n``) sits between two special
tokens, so BPE cannot merge it with anything: the expansion is spliced as ids, each text piece
tokenized alone (``tests/tokenize/families/test_minicpmv4_6.py`` checks ids against the
processor, up to two-digit k), and the counter numbers it per sample (:meth:`MiniCPMV4_6Counter.numbered`).
Example: 1000x300 -> grid (1, 3) (multiple 2: 1x2 / 1x3 / 2x1 / 1x1 -> log 3 closest to
log 3.33); source 224x840 px -> 16*60/16 = 60 tokens; 3 slices of 448x448 px -> 64 tokens each.

Video is not counted in closed form: ``MiniCPMV4_6VideoProcessor`` (torchvision only) stacks
sub-second frames into canvases and slices frames by content sizes; :attr:`counts_video` is
False, so video samples run the real processor (exact) or become ``processor_rejected`` rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from families.counter import MediaCount, MediaRejected
from families.minicpmv4_6.settings import MiniCPMV4_6Settings
from families.processor import ProcessorBundle
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


def ensure_divide(length: float, divisor: int) -> int:
    """``ensure_divide`` of the image processor: round to a multiple, at least one."""
    return max(round(length / divisor) * divisor, divisor)


def best_resize(
    height: float, width: float, *, scale_resolution: int, multiple: int, allow_upscale: bool
) -> tuple[int, int]:
    """``find_best_resize``: (height, width) in pixels, each a multiple of ``multiple`` (P * merge)."""
    if height * width > scale_resolution * scale_resolution or allow_upscale:
        aspect_ratio = width / height
        height = int(scale_resolution / math.sqrt(aspect_ratio))
        width = int(height * aspect_ratio)
    return ensure_divide(height, multiple), ensure_divide(width, multiple)


def slice_grid(height: int, width: int, *, max_slice_nums: int, scale_resolution: int) -> tuple[int, int] | None:
    """``get_sliced_grid``: (rows, cols), or None when the image is not sliced."""
    log_ratio = math.log(width / height)
    ratio = width * height / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(ratio), max_slice_nums)
    if multiple <= 1:
        return None
    best = (1, 1)
    min_error = float("inf")
    for num_slices in (multiple - 1, multiple, multiple + 1):
        if num_slices == 1 or num_slices > max_slice_nums:
            continue
        for rows in range(1, num_slices + 1):
            if num_slices % rows == 0:
                cols = num_slices // rows
                error = abs(log_ratio - math.log(cols / rows))
                if error < min_error or (error == min_error and rows > best[0]):
                    best, min_error = (rows, cols), error
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class ImagePlan:
    """What the image processor makes of one image: tokens of the source image, grid, tokens per slice."""

    source_tokens: int
    source_size: tuple[int, int]  # (height, width) in patches
    grid: tuple[int, int] | None  # (rows, cols)
    slice_tokens: int
    slice_size: tuple[int, int]  # (height, width) in patches of every slice

    @property
    def num_slices(self) -> int:
        return 0 if self.grid is None else self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.source_tokens + self.num_slices * self.slice_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6Counter:
    counts_video: ClassVar[bool] = False  # video samples take the real processor (module docstring)

    settings: MiniCPMV4_6Settings  # shared with the layout
    tokenizer: Any  # the digits of <image_id>k</image_id> are text, tokenized alone
    markup_ids: dict[str, int]  # image_start_token ... image_id_end_token -> id
    newline_ids: tuple[int, ...]  # "\n" between slice rows, tokenized alone

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> MiniCPMV4_6Counter:
        settings = MiniCPMV4_6Settings.from_processor(bundle)
        tokenizer: Any = bundle.tokenizer
        return cls(
            settings=settings,
            tokenizer=tokenizer,
            markup_ids={name: bundle.token_id(token, name) for name, token in settings.markup.items()},
            newline_ids=tuple(tokenizer.encode("\n", add_special_tokens=False)),
        )

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.settings.video_token_id

    def plan(self, width: int, height: int) -> ImagePlan:
        """The source image and slices of a ``width`` x ``height`` image (module docstring)."""
        s = self.settings
        multiple = s.patch_size * s.merge_factor
        grid = (
            slice_grid(height, width, max_slice_nums=s.max_slice_nums, scale_resolution=s.scale_resolution)
            if s.slice_mode
            else None
        )
        sh, sw = best_resize(
            height, width, scale_resolution=s.scale_resolution, multiple=multiple, allow_upscale=grid is None
        )
        source = (sh // s.patch_size, sw // s.patch_size)
        slice_size = (0, 0)
        if grid is not None:
            rows, cols = grid
            rh, rw = ensure_divide(height, rows), ensure_divide(width, cols)
            bh, bw = best_resize(
                rh / rows, rw / cols, scale_resolution=s.scale_resolution, multiple=multiple, allow_upscale=True
            )
            slice_size = (bh // s.patch_size, bw // s.patch_size)
        per_token = s.patches_per_token
        return ImagePlan(
            source_tokens=source[0] * source[1] // per_token,
            source_size=source,
            grid=grid,
            slice_tokens=slice_size[0] * slice_size[1] // per_token,
            slice_size=slice_size,
        )

    def count_image(self, width: int, height: int) -> MediaCount:
        """The image as the first of its sample (``<image_id>0</image_id>``); `numbered` renumbers it."""
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        plan = self.plan(width, height)
        m, pad = self.markup_ids, self.settings.image_token_id
        ids = [*self._image_id(0), m["image_start_token"], *([pad] * plan.source_tokens), m["image_end_token"]]
        rows, cols = plan.grid or (0, 0)
        one = (m["slice_start_token"], *([pad] * plan.slice_tokens), m["slice_end_token"])
        for row in range(rows):
            if row:
                ids += self.newline_ids
            ids += one * cols
        return MediaCount(
            kind="image",
            grid_t=1,
            grid_h=rows,
            grid_w=cols,
            num_tokens=plan.num_tokens,
            expansion=tuple(ids),
            num_tiles=1 + plan.num_slices,
        )

    def numbered(self, count: MediaCount, index: int) -> MediaCount:
        """``count`` as the sample's ``index``-th item of its kind (from 0): its ``<image_id>`` tag."""
        first = self._image_id(0)
        if not first or index == 0 or count.expansion[: len(first)] != first:
            return count
        return replace(count, expansion=self._image_id(index) + count.expansion[len(first) :])

    def _image_id(self, index: int) -> tuple[int, ...]:
        if not self.settings.use_image_id:
            return ()
        digits = self.tokenizer.encode(str(index), add_special_tokens=False)
        return (self.markup_ids["image_id_start_token"], *digits, self.markup_ids["image_id_end_token"])

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected("MiniCPM-V 4.6 video has no closed-form count; it needs the real processor (torchvision)")

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``MiniCPMV4_6VideoProcessor.sample_frames`` takes ``max_num_frames`` (no fps)."""
        return {} if sampling.max_frames is None else {"max_num_frames": sampling.max_frames}
