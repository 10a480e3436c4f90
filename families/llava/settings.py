"""What both LLaVA-NeXT / LLaVA-OneVision faces read from the processor, derived once.

The tiling (pinpoints, cut, tile size) from the effective call-time image settings
(`families.settings.effective_image_settings`), the feature grid of one tile and the placeholder
ids from the processor itself, so the processor must be buildable here. The counter writes the
expansion with them (`families.llava.counter` has the rules); the layout checks the processor's
tiles against the same pinpoints and counts a tile's features with the same grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.counter import NO_VIDEO_TOKEN
from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings


def _get(size: Any, key: str) -> Any:
    """A key of a size dict or SizeDict (None when absent)."""
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _size_hw(size: Any) -> tuple[int, int] | None:
    """(height, width) of a size: height + width, or a shortest edge squared (a square tile)."""
    if _get(size, "height") and _get(size, "width"):
        return int(_get(size, "height")), int(_get(size, "width"))
    if _get(size, "shortest_edge"):
        return int(_get(size, "shortest_edge")), int(_get(size, "shortest_edge"))
    return None


TILE_SETTINGS = ("size", "crop_size", "do_resize", "do_center_crop", "image_grid_pinpoints")


@dataclass(frozen=True, kw_only=True, slots=True)
class TileLayout:
    """How the image processor cuts an image (``_preprocess`` / ``get_image_patches``)."""

    pinpoints: tuple[tuple[int, int], ...]
    cut: int  # P: divide_to_patches' square patch side
    tile_height: int  # th, tw: a processed tile's size (what replace_image_token reads back)
    tile_width: int

    @classmethod
    def from_settings(cls, settings: dict[str, Any], source: str) -> TileLayout:
        size = _size_hw(settings["size"])
        crop = _size_hw(settings["crop_size"])
        pinpoints = tuple((int(h), int(w)) for h, w in settings["image_grid_pinpoints"] or ())
        if size is None or not pinpoints:
            raise ProcessorLoadError(f"{source}: LLaVA image processor without size or image_grid_pinpoints")
        crop_height = _get(settings["crop_size"], "height")
        cut = int(crop_height) if crop_height else size[0]  # _preprocess's patch_size
        if settings["do_center_crop"] and crop is not None:
            tile = crop
        elif settings["do_resize"]:
            tile = size
        else:
            raise ProcessorLoadError(f"{source}: LLaVA image processor with do_resize off is not counted")
        return cls(pinpoints=pinpoints, cut=cut, tile_height=tile[0], tile_width=tile[1])


@dataclass(frozen=True, kw_only=True, slots=True)
class LlavaSettings:
    """The processor's settings both faces use (`LlavaCounter`, `LlavaLayout`)."""

    image_token_id: int  # <image>
    video_token_id: int  # <video> (OneVision) or NO_VIDEO_TOKEN
    tiles: TileLayout
    feature_rows: int  # ph, pw: one tile's feature grid
    feature_cols: int
    base_features: int  # the whole-image tile's features
    max_num_patches: int | None  # OneVision's "anyres_max_N"; None for NeXT
    drop_one: bool  # vision_feature_select_strategy == "default"
    num_image_tokens: int  # OneVision: features of one tile (multi-image and video rules)
    onevision: bool

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> LlavaSettings:
        processor: Any = bundle.processor  # the class's own attributes (image_token_id, ...)
        if processor is None:
            raise ProcessorLoadError(f"{bundle.source}: {bundle.processor_class} could not be built here")
        tiles = TileLayout.from_settings(effective_image_settings(bundle, TILE_SETTINGS), bundle.source)
        onevision = bundle.processor_class == "LlavaOnevisionProcessor"
        if onevision:
            side = int(math.sqrt(processor.num_image_tokens))
            rows = cols = side
            base = int(processor.num_image_tokens)
            # the processor's own parse: str.strip of the character set "anyres_max_" (so "anyres_max_9" -> 9)
            max_num_patches: int | None = int(processor.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005
            video_token_id = bundle.token_id("<video>", "video_token")
        else:
            rows, cols = tiles.tile_height // processor.patch_size, tiles.tile_width // processor.patch_size
            base = rows * cols + int(processor.num_additional_image_tokens)
            max_num_patches = None
            video_token_id = NO_VIDEO_TOKEN
        return cls(
            image_token_id=int(processor.image_token_id),
            video_token_id=video_token_id,
            tiles=tiles,
            feature_rows=rows,
            feature_cols=cols,
            base_features=base,
            max_num_patches=max_num_patches,
            drop_one=processor.vision_feature_select_strategy == "default",
            num_image_tokens=int(getattr(processor, "num_image_tokens", None) or base),
            onevision=onevision,
        )
