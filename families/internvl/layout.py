"""InternVL 3 / 3.5 (``InternVLProcessor`` + ``GotOcr2ImageProcessor``): 448 px tiles, counted per image.

The processor passes its class's ``images_kwargs`` (``crop_to_patches=True``) over the
checkpoint's ``preprocessor_config.json`` (``false``) to the image processor, which resizes an
image to the ``cols x rows`` tile canvas closest to its aspect ratio
(``get_optimal_tiled_canvas``), cuts ``cols * rows`` tiles and, when there are more than one,
adds a thumbnail of the whole image: ``pixel_values`` [tiles, 3, 448, 448] and ``num_patches``
[tiles] per image. ``InternVLForConditionalGeneration`` takes the tiles of every image of the
row concatenated in token order (``pixel_values`` [sum tiles, 3, 448, 448], joined ``cat``),
embeds each tile alone (InternViT attends within a tile) and scatters the ``image_seq_length``
features of each tile, in order, onto the ``<IMG_CONTEXT>`` tokens; it needs no per-image
sizes because every tile is full size and the text carries ``image_seq_length * tiles``
placeholders per image.

What the plan is checked against, in the InternVL counter's convention
(`families.internvl.counter`): grid ``(1, rows, cols)`` of the canvas the image
processor cut (``(1, 1, 1)`` without cropping), ``num_patches`` tiles from the processor's
output (cross-checked against the canvas: ``cols * rows`` plus the thumbnail), and
``image_seq_length * tiles`` ``<IMG_CONTEXT>`` tokens (``<img>`` / ``</img>`` are text).
Example (448 px tiles, 1..12): a 112 x 56 image is canvas (2, 1): 2 tiles + thumbnail = 3
tiles, grid (1, 1, 2), 768 tokens. Positions restart per sample (1-D rotary). Images only:
InternVL video frames share ``pixel_values`` with images in token order and have no closed-form
count in `prep tokenize`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from families.internvl.settings import InternVLSettings
from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle

PATCHES_PER_TOKEN = 4  # InternVL's pixel shuffle (downsample_ratio 0.5) merges 2 x 2 ViT patches per token


@dataclass(frozen=True, kw_only=True, slots=True)
class InternVLLayout:
    """Tiles of every image concatenated in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False

    settings: InternVLSettings  # shared with the counter
    image_processor: Any
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> InternVLLayout:
        """From the loaded processor (the processor must load: image_seq_length)."""
        return cls(settings=InternVLSettings.from_processor(bundle), image_processor=bundle.image_processor)

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    def _canvas(self, image: Image.Image) -> tuple[int, int]:
        """(cols, rows) the image processor cuts, by its own ``get_optimal_tiled_canvas`` call."""
        if not (self.settings.crop_to_patches and self.settings.max_patches > 1):
            return 1, 1
        width, height = image.size
        cols, rows = get_optimal_tiled_canvas(
            (height, width),
            (self.settings.tile_height, self.settings.tile_width),
            self.settings.min_patches,
            self.settings.max_patches,
        )
        return int(cols), int(rows)

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor(
            images=[image],
            crop_to_patches=self.settings.crop_to_patches,
            min_patches=self.settings.min_patches,
            max_patches=self.settings.max_patches,
            return_tensors="pt",
            **self.pixel_kwargs,
        )
        pixels, tiles = got["pixel_values"], int(got["num_patches"][0])
        cols, rows = self._canvas(image)
        if tiles != pixels.shape[0] or tiles != (1 if cols * rows == 1 else cols * rows + 1):
            raise ValueError(f"image processor made {pixels.shape[0]} tiles, num_patches {tiles}, canvas {cols}x{rows}")
        return ItemInputs(
            tensors={"pixel_values": pixels},
            grid_thw=(1, rows, cols),
            num_tiles=tiles,
            num_tokens=self.settings.image_seq_length * tiles,
            num_patches=self.settings.image_seq_length * tiles * PATCHES_PER_TOKEN,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("InternVL video is not trained here (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
