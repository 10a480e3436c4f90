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

Video (``MiniCPMV4_6VideoProcessor``, torchvision only, and ``replace_video_token``) is counted in
closed form from the container header (frame count T, float rate r as PyAV reads it, width,
height) and the sampling settings (``max_num_frames`` M: ``VideoSampling.max_frames`` else the
video processor's; ``stack_frames`` k from its config). Nothing reads pixel values (no
de-duplication by content), so the count is exact wherever transformers' PyAV reader decodes T
frames, as `prep.sources.media` and `train.media` assume for every family:

- ``sample_frames``, duration d = T / r: one main frame a second, index ``int(s * r)`` for
  s < ceil(d); past M seconds, 0.1 s steps (``min(int(round(i * 0.1, 1) * r), T - 1)``)
  spread over M by ``np.linspace``. With k > 1 also the sub-second times s + j/k < d (at most
  M(k-1), spread alike), index ``min(int(t * r), T - 1)``. VideoSampling.fps is not used: the
  processor takes no fps.
- the PyAV reader keeps every decoded frame whose index is listed, once, in time order, up to
  the last listed index (`VideoPlan.frame_indices`): repeated indices (r < 1, or sub-second
  times that land on a main frame) give fewer frames than indices.
- ``_preprocess`` (k > 1) takes the *last* n (the number of sub-second times) decoded frames as
  the sub-second ones and the rest as main frames, whatever their times; per second, its
  sub-second frames (2, 3, 4 or more) are stacked on one canvas (``concat_frames_as_image``: 2x2
  for 4, the squarer of 1xn / nx1 for 2 and 3, else 1xn; 6 px lines), placed after that
  second's main frame. Where that leaves no main frame, or a second with times but no frame,
  the processor fails (ValueError / RuntimeError): an error row here.
- every unit (frame or canvas) is sliced like an image (`slice_plan`, the video processor's
  own settings) and written as ``<image>`` + n0 x ``<|video_pad|>`` + ``</image>`` + slice rows,
  units back to back; ``<image_id>k</image_id>`` once before the video, k its place among the
  sample's videos (images are numbered apart).

transformers' d is ``float(T / Fraction(rate))``; from the float rate we compute T / r, equal to
it when the rate is exactly a float (`exact_rate`: 30, 25, 12.5, ...), else within 3 ulps. The
plan reads d only through ``ceil(d)``, ``d > M``, ``int(d / 0.1)`` and ``t < d``, all monotone:
where they agree 4 ulps either side the count is exact, else (an NTSC rate whose duration is
exactly on a boundary, e.g. 30000 frames at 30000/1001: 1001 s) an error row, never a guess.
Headers without a frame count (some mkv/webm): `prep.sources.media` counts packets, but
transformers' reader sees T = 0 and fails; the closed form counts what the frames give (and
`train.media` decodes them the same way). With ``do_sample_frames`` or ``do_resize`` off in the
video config, :attr:`MiniCPMV4_6Counter.counts_video` is False: the real processor runs.
Example: 46 frames at 30000/1001 fps, 200x120 (1.53 s): frames 0 and 29, each unsliced at
336x560 px -> 60 tokens: ``<image_id>0</image_id>`` + 2 x (``<image>`` + 60 + ``</image>``);
with k = 3 the reader keeps frames 0, 9, 19, 29, 39, main 0 and 9, canvases of 2 (246x200:
frames 19 and 29 stacked tall) and 1 frame: 4 units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np

from families.counter import MediaCount, MediaRejected
from families.minicpmv4_6.settings import MiniCPMV4_6Settings, SliceRule
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


def slice_plan(width: int, height: int, rule: SliceRule) -> ImagePlan:
    """What the image (or video) processor makes of one ``width`` x ``height`` picture (module docstring)."""
    scale_resolution, max_slice_nums, patch_size = rule.scale_resolution, rule.max_slice_nums, rule.patch_size
    merge_factor, slice_mode = rule.merge_factor, rule.slice_mode
    multiple = patch_size * merge_factor
    grid = (
        slice_grid(height, width, max_slice_nums=max_slice_nums, scale_resolution=scale_resolution)
        if slice_mode
        else None
    )
    sh, sw = best_resize(
        height, width, scale_resolution=scale_resolution, multiple=multiple, allow_upscale=grid is None
    )
    source = (sh // patch_size, sw // patch_size)
    slice_size = (0, 0)
    if grid is not None:
        rows, cols = grid
        rh, rw = ensure_divide(height, rows), ensure_divide(width, cols)
        bh, bw = best_resize(
            rh / rows, rw / cols, scale_resolution=scale_resolution, multiple=multiple, allow_upscale=True
        )
        slice_size = (bh // patch_size, bw // patch_size)
    per_token = merge_factor * merge_factor
    return ImagePlan(
        source_tokens=source[0] * source[1] // per_token,
        source_size=source,
        grid=grid,
        slice_tokens=slice_size[0] * slice_size[1] // per_token,
        slice_size=slice_size,
    )


CANVAS_LINE = 6  # ``concat_frames_as_image``'s line_width: black pixels between stacked frames


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoPlan:
    """What the video processor makes of one video: the frames it decodes, then its visual units."""

    frame_indices: tuple[int, ...]  # decoded frames, sorted and unique (as the PyAV reader keeps them)
    units: tuple[tuple[int, int], ...]  # (height, width) of each unit in token order: frames and canvases


def sample_frames(
    num_frames: int, fps: float, duration: float, *, max_num_frames: int, stack_frames: int
) -> tuple[list[int], list[float]]:
    """``MiniCPMV4_6VideoProcessor.sample_frames``: (main then sub-second indices, sub-second timestamps).

    The arithmetic is the processor's, step for step (float products, ``round(i * 0.1, 1)`` on
    Python ints, ``np.linspace(..., dtype=int)``), so the indices are its indices.
    """
    seconds = math.ceil(duration)
    if duration > max_num_frames:  # long: 0.1 s steps, spread over max_num_frames
        steps = int(duration / 0.1)
        picks: Any = range(steps) if steps <= max_num_frames else np.linspace(0, steps - 1, max_num_frames, dtype=int)
        main = [min(int(round(int(i) * 0.1, 1) * fps), num_frames - 1) for i in picks]
    else:
        main = [int(i * fps) for i in range(seconds)]
    stamps: list[float] = []
    if stack_frames > 1:
        stamps = [
            sec + j / stack_frames
            for sec in range(seconds)
            for j in range(1, stack_frames)
            if sec + j / stack_frames < duration
        ]
        cap = max_num_frames * (stack_frames - 1)
        if len(stamps) > cap:
            stamps = [stamps[int(i)] for i in np.linspace(0, len(stamps) - 1, cap, dtype=int)]
    sub = [min(int(t * fps), num_frames - 1) for t in stamps]
    return main + sub, stamps


def canvas_size(count: int, height: int, width: int) -> tuple[int, int]:
    """``concat_frames_as_image``: (height, width) of ``count`` frames stacked on one canvas."""

    def ratio_error(rows: int, cols: int) -> float:
        canvas_width = cols * width + (cols - 1) * CANVAS_LINE
        canvas_height = rows * height + (rows - 1) * CANVAS_LINE
        return abs(canvas_width / max(1, canvas_height) - 1.0)

    if count == 4:
        rows, cols = 2, 2
    elif count in (2, 3):
        wide, tall = (1, count), (count, 1)
        errors = ratio_error(*wide), ratio_error(*tall)
        if count == 2 and errors[0] == errors[1]:
            rows, cols = wide if width / height >= 1.0 else tall
        else:
            rows, cols = tall if errors[1] < errors[0] else wide  # np.argmin: the first on a tie
    else:
        rows, cols = 1, count
    return rows * height + (rows - 1) * CANVAS_LINE, cols * width + (cols - 1) * CANVAS_LINE


def _duration_key(duration: float, max_num_frames: int, stack_frames: int) -> tuple[int, bool, int, int]:
    """Everything the plan reads of the duration; each part is monotone in it (see `video_plan`)."""
    seconds = math.ceil(duration)
    long = duration > max_num_frames
    last = sum(1 for j in range(1, stack_frames) if seconds - 1 + j / stack_frames < duration)
    return seconds, long, int(duration / 0.1) if long else 0, last


def exact_rate(fps: float) -> bool:
    """Whether ``fps`` is the container's rational rate itself (PyAV rates have denominators < 2^31).

    A rate p/q that rounds to a float of denominator D <= 1024 below 4096 fps equals it: two
    different such fractions differ by >= 1/(qD) > 2^-41, the float by <= 4096 * 2^-53.
    """
    return fps < 4096 and Fraction(fps).denominator <= 1024


def video_plan(meta: VideoMeta, *, max_num_frames: int, stack_frames: int) -> VideoPlan:
    """The decoded frames and visual units of a video (module docstring); MediaRejected where the
    processor fails or the float duration cannot be decided."""
    total, fps = meta.num_frames, meta.fps
    duration = total / fps
    # transformers takes the duration as float(frames / Fraction rate), we have only float(rate):
    # the two agree exactly for an exact rate, else within 3 ulps; the plan reads the duration
    # only through _duration_key, so equal keys 4 ulps either side decide it
    if not exact_rate(fps):
        lo = hi = duration
        for _ in range(4):
            lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        if _duration_key(lo, max_num_frames, stack_frames) != _duration_key(hi, max_num_frames, stack_frames):
            raise MediaRejected(
                f"{total} frames at {fps!r} fps: the duration lies on a frame-sampling boundary that the float "
                "frame rate cannot decide; the closed form does not guess"
            )
    indices, stamps = sample_frames(total, fps, duration, max_num_frames=max_num_frames, stack_frames=stack_frames)
    # transformers' PyAV reader keeps each decoded frame whose index is listed, up to the last listed one
    kept = tuple(sorted({i for i in indices if 0 <= i <= indices[-1] and i < total}))
    frame = (meta.height, meta.width)
    if stack_frames <= 1:
        return VideoPlan(frame_indices=kept, units=(frame,) * len(kept))
    # _preprocess takes the last len(stamps) decoded frames as the sub-second ones, whatever was decoded
    main = max(len(kept) - len(stamps), 0) if stamps else len(kept)
    sub = len(kept) - main
    canvases: list[tuple[int, int] | None] = []
    cursor = 0
    for sec in range(math.ceil(duration)):
        start = cursor
        while cursor < len(stamps) and stamps[cursor] < sec + 1:
            cursor += 1
        stacked = min(cursor, sub) - min(start, sub)
        if cursor > start and stacked <= 0:
            raise MediaRejected(f"{total} frames at {fps!r} fps: the video processor stacks no frame for second {sec}")
        canvases.append(canvas_size(stacked, *frame) if cursor > start else None)
    units: list[tuple[int, int]] = []
    for i in range(main):
        units.append(frame)
        canvas = canvases[i] if i < len(canvases) else None
        if canvas is not None:
            units.append(canvas)
    if not units:
        raise MediaRejected(f"{total} frames at {fps!r} fps: the video processor keeps no main frame")
    return VideoPlan(frame_indices=kept, units=tuple(units))


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6Counter:
    settings: MiniCPMV4_6Settings  # shared with the layout
    tokenizer: Any  # the digits of <image_id>k</image_id> are text, tokenized alone
    markup_ids: dict[str, int]  # image_start_token ... image_id_end_token -> id
    newline_ids: tuple[int, ...]  # "\n" between slice rows, tokenized alone
    _image_ids: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

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
        return slice_plan(width, height, s)

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
        """``<image_id>k</image_id>`` in ids, tokenized once per k (the first 1024 kept)."""
        found = self._image_ids.get(index)
        if found is not None:
            return found
        if not self.settings.use_image_id:
            return ()
        digits = self.tokenizer.encode(str(index), add_special_tokens=False)
        found = (self.markup_ids["image_id_start_token"], *digits, self.markup_ids["image_id_end_token"])
        if len(self._image_ids) < 1024:
            self._image_ids[index] = found
        return found

    @property
    def counts_video(self) -> bool:
        """Closed form where the video processor samples frames and resizes them (its defaults)."""
        return self.settings.video.do_sample_frames and self.settings.video.do_resize

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        """Every visual unit of the video (module docstring), each expanded like an image."""
        if not self.counts_video:
            raise MediaRejected("MiniCPM-V 4.6 video without frame sampling or resizing has no closed form")
        plan = video_plan(
            meta, max_num_frames=self.max_num_frames(sampling), stack_frames=self.settings.video.stack_frames
        )
        units = {size: self._video_unit(*size) for size in set(plan.units)}
        ids = list(self._image_id(0))
        for size in plan.units:
            ids += units[size][0]
        main = units[plan.units[0]][1]  # the first unit is always a main frame
        rows, cols = main.grid or (0, 0)
        return MediaCount(
            kind="video",
            grid_t=len(plan.units),
            grid_h=rows,
            grid_w=cols,
            num_tokens=sum(units[size][1].num_tokens for size in plan.units),
            expansion=tuple(ids),
            num_tiles=sum(1 + units[size][1].num_slices for size in plan.units),
            frame_indices=plan.frame_indices,
        )

    def _video_unit(self, height: int, width: int) -> tuple[list[int], ImagePlan]:
        """``replace_video_token``'s text of one unit (``<image>``, the video token, slices) and its plan."""
        v = self.settings.video
        unit = slice_plan(width, height, v)
        m, pad = self.markup_ids, self.settings.video_token_id
        ids = [m["image_start_token"], *([pad] * unit.source_tokens), m["image_end_token"]]
        rows, cols = unit.grid or (0, 0)
        piece = (m["slice_start_token"], *([pad] * unit.slice_tokens), m["slice_end_token"])
        for row in range(rows):
            if row:
                ids += self.newline_ids
            ids += piece * cols
        return ids, unit

    def max_num_frames(self, sampling: VideoSampling) -> int:
        return self.settings.video.max_num_frames if sampling.max_frames is None else sampling.max_frames

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``MiniCPMV4_6VideoProcessor.sample_frames`` takes ``max_num_frames`` (no fps, no minimum)."""
        return {} if sampling.max_frames is None else {"max_num_frames": sampling.max_frames}
