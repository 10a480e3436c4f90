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
`prep.tokenize.families.idefics3` counts them. Positions: 1-D, restarting per sample (Llama
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

import transformers
from PIL import Image

from packvlm.processor_kwargs import call_images_kwargs, class_images_kwargs
from train.families.base import IMAGE, DecodedVideo, ItemInputs, Join, Rope, SampleInputs, register_layout
from train.pixels import RAW_PIXELS


@register_layout("Idefics3Processor", "SmolVLMProcessor")
@dataclass(frozen=True, kw_only=True, slots=True)
class Idefics3Layout:
    """Tiles of all images of a row along dim 1; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat_dim1", "pixel_attention_mask": "cat_dim1"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False  # SmolVLM2 video: no count in prep (module docstring)

    image_processor: Any
    #: what the processor passes its image processor (`packvlm.processor_kwargs`)
    images_kwargs: dict[str, Any]
    image_token_id: int
    image_seq_len: int  # <image> tokens per tile
    tile: int  # S = max_image_size.longest_edge
    #: passed to every image-processor call: `train.pixels.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: Any) -> Idefics3Layout:
        """From a `prep.tokenize.processor.ProcessorBundle`."""
        processor = bundle.processor
        if processor is not None:
            merged = call_images_kwargs(processor)
        else:
            merged = class_images_kwargs(getattr(transformers, bundle.processor_class, None))
        seq_len = getattr(processor, "image_seq_len", None) or bundle.processor_config.get("image_seq_len", 169)
        return cls(
            image_processor=bundle.image_processor,
            images_kwargs={**merged, "return_row_col_info": True, "return_tensors": "pt"},
            image_token_id=bundle.token_id("<image>", "image_token"),
            image_seq_len=int(seq_len),
            tile=int((merged.get("max_image_size") or bundle.image_processor.max_image_size)["longest_edge"]),
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([[image]], **self.images_kwargs, **self.pixel_kwargs)
        pixels, mask = got["pixel_values"], got["pixel_attention_mask"]
        rows, cols = int(got["rows"][0][0]), int(got["cols"][0][0])
        tiles = int(pixels.shape[1])
        if tuple(pixels.shape[-2:]) != (self.tile, self.tile):
            raise ValueError(f"tiles of {tuple(pixels.shape[-2:])} px, not {self.tile}x{self.tile}: cannot cat_dim1")
        return ItemInputs(
            tensors={"pixel_values": pixels, "pixel_attention_mask": mask},
            grid_thw=(1, rows, cols),
            num_tiles=tiles,
            num_tokens=self.image_seq_len * tiles,
            # the processor knows no patch size: the tower's output tokens stand for its compute
            num_patches=self.image_seq_len * tiles,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("no video layout for Idefics3 / SmolVLM (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
