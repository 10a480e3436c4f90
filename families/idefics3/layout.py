"""Idefics3 / SmolVLM / SmolVLM2 (``Idefics3Processor``, ``SmolVLMProcessor``): tiles of one size.

The image processor turns an image into ``rows x cols`` tiles plus a global image (a split
image), or one tile (an image that fits a tile, or splitting off): ``pixel_values``
[1, tiles, 3, S, S] and ``pixel_attention_mask`` [1, tiles, S, S] with S =
``max_image_size.longest_edge``; every tile is S x S (split tiles are cut at S, the global
image and unsplit images are resized to S x S), so the mask of a real tile is all ones. The
model takes ``[B, N, 3, S, S]``, flattens ``B * N`` and drops all-zero images as batch padding
(``real_images_inds``); one packed row is B = 1 with the tiles of every image of every sample
along dim 1, in token order (``cat_dim1``): no padding image is ever made, so nothing is
dropped.

An item expands to ``image_seq_len`` ``<image>`` tokens per tile; the plan records grid
``(1, rows, cols)`` (``(1, 0, 0)`` unsplit) and ``num_tiles = rows * cols + 1`` (1 unsplit), as
`families.idefics3.counter` counts them. Positions: 1-D, restarting per sample (Llama
text model).

Note (transformers behaviour, shared with an unpacked batch): a *real* tile whose normalised
pixels are all exactly 0 would be dropped as padding too. With the checkpoints' mean/std 0.5
and rescale 1/255 no 8-bit pixel maps to 0, so it cannot happen there; a config without
normalisation would drop a black tile (Idefics3 then fails the model's feature count check).
Video (SmolVLM2) is not counted by `prep tokenize` (no closed form), so it is not laid out here.

Example (example ``idefics3``: size 1456, tile 364, 169 per tile): a 112x28 image -> 1456x364
-> rows 1 x cols 4 + global = 5 tiles, ``pixel_values`` [1, 5, 3, 364, 364], 845 tokens, grid
(1, 1, 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.idefics3.settings import Idefics3Settings
from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class Idefics3Layout:
    """Tiles of all images of a row along dim 1; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat_dim1", "pixel_attention_mask": "cat_dim1"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False  # SmolVLM2 video: no count in prep (module docstring)

    settings: Idefics3Settings  # shared with the counter
    image_processor: Any
    #: what the processor passes its image processor (``settings.images_kwargs``), plus rows / cols and tensors
    images_kwargs: dict[str, Any]
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Idefics3Layout:
        """From the loaded processor."""
        settings = Idefics3Settings.from_processor(bundle)
        return cls(
            settings=settings,
            image_processor=bundle.image_processor,
            images_kwargs={**settings.images_kwargs, "return_row_col_info": True, "return_tensors": "pt"},
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([[image]], **self.images_kwargs, **self.pixel_kwargs)
        pixels, mask = got["pixel_values"], got["pixel_attention_mask"]
        rows, cols = int(got["rows"][0][0]), int(got["cols"][0][0])
        tiles = int(pixels.shape[1])
        tile = self.settings.tile
        if tuple(pixels.shape[-2:]) != (tile, tile):
            raise ValueError(f"tiles of {tuple(pixels.shape[-2:])} px, not {tile}x{tile}: cannot cat_dim1")
        return ItemInputs(
            tensors={"pixel_values": pixels, "pixel_attention_mask": mask},
            grid_thw=(1, rows, cols),
            num_tiles=tiles,
            num_tokens=self.settings.image_seq_len * tiles,
            # the processor knows no patch size: the tower's output tokens stand for its compute
            num_patches=self.settings.image_seq_len * tiles,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("no video layout for Idefics3 / SmolVLM (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
