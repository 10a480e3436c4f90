"""What both LFM2-VL faces read from the processor, derived once.

``Lfm2VlImageProcessor`` exists only in torchvision form, so `prep tokenize` without
torchvision holds its ``preprocessor_config.json`` alone
(`families.processor.SettingsOnlyImageProcessor`): a setting the file leaves out takes the
class default, declared here (:data:`CLASS_DEFAULTS`; a torchvision test checks them against
the class). The processor call adds no image setting of its own (``images_kwargs`` is only
``return_row_col_info``); ``use_image_special_tokens`` is a processor class attribute that
``processor_config.json`` cannot change (the key is not an ``__init__`` argument: it is dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings

#: ``Lfm2VlImageProcessor``'s class attributes (transformers 5.24) that shape token counts
CLASS_DEFAULTS: dict[str, Any] = {
    "downsample_factor": 2,
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 10,
    "use_thumbnail": True,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "encoder_patch_size": 16,
    "tile_size": 512,
    "max_pixels_tolerance": 2.0,
}
USE_IMAGE_SPECIAL_TOKENS = True  # Lfm2VlProcessor.use_image_special_tokens
IMAGE_TOKEN, THUMBNAIL, IMAGE_START, IMAGE_END = "<image>", "<|img_thumbnail|>", "<|image_start|>", "<|image_end|>"


def position_token(row: int, col: int) -> str:
    """The tile position token the processor writes before tile (row, col), 1-based."""
    return f"<|img_row_{row}_col_{col}|>"


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm2VlSettings:
    """The processor's settings both faces use (`Lfm2VlCounter`, `Lfm2VlLayout`)."""

    downsample_factor: int  # pixel unshuffle: d x d patches per token
    encoder_patch_size: int  # SigLIP2 patch side p
    min_tiles: int  # 1 and 1 when splitting is off (as ``_preprocess`` sets them)
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    tile_size: int
    max_pixels_tolerance: float
    use_image_special_tokens: bool
    image_token_id: int  # <image>: one per vision embedding
    image_start_id: int
    image_end_id: int
    thumbnail_id: int
    position_ids: dict[tuple[int, int], int]  # (row, col) -> <|img_row_R_col_C|>, for every grid max_tiles allows

    @property
    def splitting(self) -> bool:
        """``resize_and_split``'s ``do_image_splitting``: tiles unless min and max tiles are both 1."""
        return not self.min_tiles == self.max_tiles == 1

    @property
    def max_num_patches(self) -> int:
        """What ``_preprocess`` pads each encoder input to (not the file's ``max_num_patches``)."""
        tile_patches = (self.tile_size // self.encoder_patch_size) ** 2 if self.splitting else 0
        return max(self.max_image_tokens * self.downsample_factor**2, tile_patches)

    @property
    def tokens_per_tile(self) -> int:
        """``_compute_tokens_per_tile``."""
        side = math.ceil((self.tile_size // self.encoder_patch_size) / self.downsample_factor)
        return side * side

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Lfm2VlSettings:
        names = tuple(CLASS_DEFAULTS)
        found = effective_image_settings(bundle, names)
        value = {n: CLASS_DEFAULTS[n] if found[n] is None else found[n] for n in names}
        splitting = bool(value["do_image_splitting"])
        min_tiles, max_tiles = (int(value["min_tiles"]), int(value["max_tiles"])) if splitting else (1, 1)
        if min_tiles > max_tiles:
            raise ProcessorLoadError(f"{bundle.source}: min_tiles {min_tiles} > max_tiles {max_tiles}; fix the config")
        # an attribute of the processor (processor_config.json cannot set it: not an __init__ argument)
        special = getattr(bundle.processor, "use_image_special_tokens", USE_IMAGE_SPECIAL_TOKENS)
        grids = {(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1) if r * c <= max_tiles}
        return cls(
            downsample_factor=int(value["downsample_factor"]),
            encoder_patch_size=int(value["encoder_patch_size"]),
            min_tiles=min_tiles,
            max_tiles=max_tiles,
            use_thumbnail=bool(value["use_thumbnail"]),
            min_image_tokens=int(value["min_image_tokens"]),
            max_image_tokens=int(value["max_image_tokens"]),
            tile_size=int(value["tile_size"]),
            max_pixels_tolerance=float(value["max_pixels_tolerance"]),
            use_image_special_tokens=bool(special),
            image_token_id=bundle.token_id(IMAGE_TOKEN, "image_token"),
            image_start_id=bundle.token_id(IMAGE_START, "image_start_token"),
            image_end_id=bundle.token_id(IMAGE_END, "image_end_token"),
            thumbnail_id=bundle.token_id(THUMBNAIL, "image_thumbnail_token"),
            position_ids={g: _single_token(bundle, position_token(*g)) for g in sorted(grids)} if splitting else {},
        )


def _single_token(bundle: ProcessorBundle, token: str) -> int:
    """The id of a tile position token; the processor writes it as text, so it must be one added token."""
    ids = bundle.tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ProcessorLoadError(
            f"{bundle.source}: the tokenizer splits {token!r} into {len(ids)} tokens; LFM2-VL tokenizers hold "
            "one token per tile position (rows and columns 1..10): use the checkpoint's tokenizer"
        )
    return int(ids[0])
