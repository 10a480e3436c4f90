"""InternVL 3 / 3.5 (``InternVLProcessor`` + ``GotOcr2ImageProcessorPil``): dynamic 448 tiling.

Image (transformers 5.23, ``models/got_ocr2/image_processing_pil_got_ocr2.py``): when
``crop_to_patches`` and ``max_patches > 1``, ``get_optimal_tiled_canvas`` picks the (cols, rows)
grid with ``min_patches <= cols*rows <= max_patches`` whose cols/rows is closest to w/h; on a
tie the later (larger or equal) grid wins when w*h > 0.5 * tile_h * tile_w * cols * rows.
``crop_image_to_patches`` then yields cols*rows tiles plus a thumbnail unless the grid is 1x1;
without cropping an image is one tile. ``InternVLProcessor.replace_image_token`` writes
``<img>`` + ``<IMG_CONTEXT>`` x (image_seq_length x tiles) + ``</img>``; the chat template
renders one ``<IMG_CONTEXT>`` per image (then ``\\n``), so the expansion is spliced in ids:
``<img>``/``</img>``/``<IMG_CONTEXT>`` are special tokens, nothing merges across them.

``crop_to_patches`` comes from ``InternVLProcessor.images_kwargs`` (True), which the processor
passes to the image processor at call time (``ProcessorMixin._merge_kwargs``), overriding the
``false`` of the checkpoints' ``preprocessor_config.json``: the effective value is read the
same way here. Example: 800x600 -> grid (4, 3) is 12 tiles + thumbnail = 13 x 256 = 3328
``<IMG_CONTEXT>`` ids, 3330 with ``<img>``/``</img>``; recorded as grid (1, rows=3, cols=4).

Video is not counted in closed form: ``replace_video_token`` writes ``Frame{i}: `` text that
BPE merges with the text before the ``<video>`` tag, and ``InternVLVideoProcessor`` imports
torchvision. :attr:`InternVLCounter.counts_video` is False, so video samples run the real
processor (exact) or, where it cannot run, become ``processor_rejected`` error rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from families.counter import MediaCount, MediaRejected
from families.internvl.settings import InternVLSettings
from families.processor import ProcessorBundle, ProcessorLoadError
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta


@lru_cache(maxsize=16)
def tile_arrangements(min_patches: int, max_patches: int) -> tuple[tuple[int, int], ...]:
    """``get_all_supported_aspect_ratios``: (cols, rows) sorted (stably) by cols*rows."""
    grids = [
        (cols, rows)
        for cols in range(1, max_patches + 1)
        for rows in range(1, max_patches + 1)
        if min_patches <= cols * rows <= max_patches
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(
    width: int, height: int, *, tile_width: int, tile_height: int, min_patches: int, max_patches: int
) -> tuple[int, int]:
    """``get_optimal_tiled_canvas``: the (cols, rows) the image is resized to and cut into."""
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for cols, rows in tile_arrangements(min_patches, max_patches):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile_height * tile_width * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class InternVLCounter:
    counts_video: ClassVar[bool] = False  # video samples take the real processor (module docstring)

    settings: InternVLSettings  # shared with the layout
    video_token_id: int  # <video>
    start_image_id: int  # <img>
    end_image_id: int  # </img>

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> InternVLCounter:
        ip = bundle.image_processor
        if not type(ip).__name__.startswith("GotOcr2ImageProcessor"):
            raise ProcessorLoadError(
                f"{bundle.source}: InternVLProcessor with {type(ip).__name__}; the closed form knows only "
                "GotOcr2ImageProcessor tiling"
            )
        return cls(
            settings=InternVLSettings.from_processor(bundle),
            video_token_id=bundle.token_id("<video>", "video_token"),
            start_image_id=bundle.token_id("<img>", "start_image_token"),
            end_image_id=bundle.token_id("</img>", "end_image_token"),
        )

    @property
    def image_token_id(self) -> int:
        """``<IMG_CONTEXT>``: the template's per-image placeholder."""
        return self.settings.image_token_id

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(cols, rows) of the tiling; (1, 1) when the processor does not crop."""
        if not (self.settings.crop_to_patches and self.settings.max_patches > 1):
            return 1, 1
        return tile_grid(
            width,
            height,
            tile_width=self.settings.tile_width,
            tile_height=self.settings.tile_height,
            min_patches=self.settings.min_patches,
            max_patches=self.settings.max_patches,
        )

    def num_tiles(self, width: int, height: int) -> int:
        """``num_patches`` of the image processor: cols*rows, plus the thumbnail when > 1."""
        cols, rows = self.grid(width, height)
        return 1 if cols * rows == 1 else cols * rows + 1

    def count_image(self, width: int, height: int) -> MediaCount:
        if width <= 0 or height <= 0:
            raise MediaRejected(f"image of size {width}x{height}")
        cols, rows = self.grid(width, height)
        tiles = 1 if cols * rows == 1 else cols * rows + 1
        n = self.settings.image_seq_length * tiles
        expansion = (self.start_image_id, *([self.settings.image_token_id] * n), self.end_image_id)
        return MediaCount(
            kind="image", grid_t=1, grid_h=rows, grid_w=cols, num_tokens=n, expansion=expansion, num_tiles=tiles
        )

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount:
        raise MediaRejected("InternVL video has no closed-form count; it needs the real processor (torchvision)")

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """``InternVLVideoProcessor.sample_frames`` takes ``fps`` (or ``num_frames``) only."""
        return {} if sampling.fps is None else {"fps": sampling.fps, "do_sample_frames": True}
