"""Idefics3 / SmolVLM / SmolVLM2 (``Idefics3Processor``, ``SmolVLMProcessor``): image tiling.

Image size (transformers 5.23, ``models/idefics3/image_processing_pil_idefics3.py``, identical in
``models/smolvlm/image_processing_pil_smolvlm.py``), on the EXIF-oriented source size:

1. ``resize`` -> ``get_resize_output_image_size``: ``_resize_output_size_rescale_to_max_len``
   scales the longest edge to ``size.longest_edge`` (up or down), the other side
   ``int(longest / aspect)`` made even, at least 1; ``_resize_output_size_scale_below_upper_bound``
   then caps the longest edge at ``MAX_IMAGE_SIZE`` (4096). Skipped when ``do_resize`` is off.
2. ``resize_for_vision_encoder``: the longer side up to a multiple of the tile
   (``max_image_size.longest_edge``), the other ``int(side / aspect)`` and then up to a multiple.
3. ``split_images``: past one tile, ``rows = (h - tile) // tile + 1`` by ``cols`` tiles plus a
   global image; a one-tile image stays whole and reports rows = cols = 0. Without
   ``do_image_splitting`` every image is one tile (rows = cols = 0).

The float arithmetic is the processor's own (``int(w / (w0 / h0))``), not a rounded ratio: it
differs at sides one pixel past a tile multiple. ``get_number_of_image_patches`` is not used: it
skips step 2's re-derivation of the short side.

Prompt (``Idefics3Processor.replace_image_token``; ``processing_smolvlm.get_image_prompt_string``
with ``_prompt_single_image`` / ``_prompt_split_image``, the same text): one tile is
``<fake_token_around_image><global-img>`` + ``<image>`` x image_seq_len +
``<fake_token_around_image>``; a split image is, per row, per column
``<fake_token_around_image><row_r_col_c>`` + ``<image>`` x image_seq_len, then ``"\\n"``; then
``"\\n"`` and the single-tile block. The row/col tags are written as text for any r, c: the
checkpoints carry tokens up to ``<row_6_col_6>`` and a larger grid (only with settings beyond
6 tiles a side) would be tokenized as BPE text, which tokenizing the expansion reproduces.

Ids, not text: the expansion opens and closes with ``<fake_token_around_image>`` and replaces
``<image>``, both added tokens (matched before BPE, no lstrip/rstrip, checked when the counter
is built), so the text on either side and the ``"\\n"`` / ``"\\n\\n"`` pieces inside are
tokenized as separate segments: ``tokenizer(expansion)`` spliced at the placeholder equals
tokenizing the replaced text. Otherwise the counter falls back to text (``expansion_runs``).

Example (SmolVLM-256M: longest edge 2048, tile 512, 64 per tile): 1000x600 -> 2048x1228 ->
2048x1536 -> rows 3 x cols 4 + global = 13 tiles; 13 x 64 = 832 ``<image>`` ids, 862 in all
(12 x (fake + row/col tag) + 2 ``"\\n"`` + 1 ``"\\n\\n"`` + fake + ``<global-img>`` + fake),
recorded as grid (1, 3, 4), num_tiles 13.

Video (SmolVLM2) is not counted here: ``SmolVLMVideoProcessor`` (frame sampling) needs
torchvision, and ``SmolVLMProcessor.replace_video_token`` writes ``num2words`` frame counts and
``"\\nFrame from MM:SS:"`` text that merges with its neighbours; ``counts_video`` is False, so
video samples take the real processor or become ``processor_rejected`` error rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from families.counter import MediaCount, MediaRejected
from families.idefics3.settings import Idefics3Settings
from families.processor import ProcessorBundle, ProcessorLoadError
from families.run_text import Piece, RunText
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta

MAX_IMAGE_SIZE = 4096  # image_processing_pil_idefics3.MAX_IMAGE_SIZE


def rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """``_resize_output_size_rescale_to_max_len`` (min_len 1): longest edge -> max_len, other side even."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def scale_below_upper_bound(height: int, width: int, max_len: int = MAX_IMAGE_SIZE) -> tuple[int, int]:
    """``_resize_output_size_scale_below_upper_bound``: cap the longest edge at max_len."""
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def vision_encoder_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """``resize_for_vision_encoder``: both sides up to multiples of the tile, the short one re-derived."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _added_token_bounded(tokenizer: Any, token: str) -> bool:
    """True when ``token`` is an added token that strips no neighbouring whitespace."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    added = tokenizer.added_tokens_decoder.get(token_id)
    return added is not None and not added.lstrip and not added.rstrip


@dataclass(frozen=True, kw_only=True, slots=True)
class Idefics3Counter:
    counts_video: ClassVar[bool] = False  # SmolVLM2 video takes the real processor (module docstring)

    settings: Idefics3Settings  # shared with the layout
    video_token_id: int  # <video> (SmolVLM2); -1 where the vocabulary has none (no video ever counted)
    tokenizer: Any = field(repr=False, compare=False)
    text_level: bool  # expansion as text (boundary tokens not bounded added tokens)
    _cache: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Idefics3Counter:
        tokenizer = bundle.tokenizer
        ip = bundle.image_processor
        if not hasattr(ip, "resize_for_vision_encoder"):
            raise ProcessorLoadError(
                f"{bundle.source}: {bundle.processor_class} with {type(ip).__name__}; the closed form knows only "
                "the Idefics3 / SmolVLM image processors' tiling"
            )
        settings = Idefics3Settings.from_processor(bundle)
        if settings.do_resize and not settings.longest_edge:
            raise ProcessorLoadError(f"{bundle.source}: image size {settings.size!r} has no longest_edge")
        video = getattr(tokenizer, "video_token", None) or "<video>"
        video_id = tokenizer.convert_tokens_to_ids(video)
        bounded = (settings.fake_image_token, settings.image_token)
        return cls(
            settings=settings,
            video_token_id=-1 if video_id in (None, tokenizer.unk_token_id) else int(video_id),
            tokenizer=tokenizer,
            text_level=not all(_added_token_bounded(tokenizer, t) for t in bounded),
        )

    @property
    def image_token_id(self) -> int:
        """``<image>``: the template's placeholder and the per-tile embedding token."""
        return self.settings.image_token_id

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) as the image processor reports them; (0, 0) for an image kept as one tile."""
        settings = self.settings
        if not settings.do_image_splitting:
            return 0, 0
        if settings.do_resize:
            height, width = rescale_to_max_len(height, width, settings.longest_edge)
            height, width = scale_below_upper_bound(height, width)
        tile = settings.tile
        height, width = vision_encoder_size(height, width, tile)
        if height > tile or width > tile:
            return (height - tile) // tile + 1, (width - tile) // tile + 1
        return 0, 0

    def expansion_runs(self, rows: int, cols: int) -> RunText:
        """``get_image_prompt_string``: the text that replaces one ``<image>`` placeholder."""
        settings = self.settings
        fake, per_tile = settings.fake_image_token, (settings.image_token, settings.image_seq_len)
        single: list[Piece] = [fake + settings.global_image_token, per_tile, fake]
        if rows == 0 and cols == 0:
            return RunText.of(single)
        pieces: list[Piece] = []
        for r in range(1, rows + 1):
            for c in range(1, cols + 1):
                pieces += [f"{fake}<row_{r}_col_{c}>", per_tile]
            pieces.append("\n")
        return RunText.of([*pieces, "\n", *single])

    def expansion_text(self, rows: int, cols: int) -> str:
        """`expansion_runs` written out."""
        return self.expansion_runs(rows, cols).text

    def _expansion_ids(self, rows: int, cols: int) -> tuple[int, ...]:
        ids = self._cache.get((rows, cols))
        if ids is None:
            encoded = self.tokenizer(self.expansion_text(rows, cols), add_special_tokens=False)
            ids = self._cache.setdefault((rows, cols), tuple(int(t) for t in encoded["input_ids"]))
        return ids

    def count_image(self, width: int, height: int) -> MediaCount:
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        rows, cols = self.grid(width, height)
        tiles = rows * cols + 1 if rows or cols else 1
        common: dict[str, Any] = dict(
            kind="image",
            grid_t=1,
            grid_h=rows,
            grid_w=cols,
            num_tokens=self.settings.image_seq_len * tiles,
            num_tiles=tiles,
        )
        if self.text_level:
            return MediaCount(**common, expansion=(), expansion_runs=self.expansion_runs(rows, cols))
        return MediaCount(**common, expansion=self._expansion_ids(rows, cols))

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected("SmolVLM video has no closed-form count; it needs the real processor (torchvision)")

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``SmolVLMVideoProcessor`` samples by ``fps`` when asked to."""
        return {} if sampling.fps is None else {"fps": sampling.fps, "do_sample_frames": True}
