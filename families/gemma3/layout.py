"""Gemma 3 (``Gemma3Processor``): square 896 px images, 256 soft tokens each, image blocks attended both ways.

The image processor (``Gemma3ImageProcessorPil``) resizes every image, and with pan-and-scan
each of its crops, to the checkpoint's square size: ``pixel_values`` [1 + crops, 3, S, S],
the whole image first, then the crops in the order the text names them
(``Gemma3Processor.replace_image_token``). It is called with the processor's merged
``images_kwargs`` (``Gemma3Processor.images_kwargs`` turns pan-and-scan off unless a call
turns it on), as the processor calls it. The model takes ``pixel_values`` [N, 3, S, S] for
the N tiles of a row, in token order, and scatters ``image_seq_length`` (256) embeddings into
each run of ``<image_soft_token>`` ids: tiles of every sample and pack join ``cat``.

What the plan is checked against, in `families.gemma3.counter`'s convention:
``num_tiles`` = 1 + crops, ``num_tokens`` = ``image_seq_length`` x tiles, grid ``(1, 1, 1)``
without crops, else ``(1, 1, k)`` for a landscape image cut into k columns and ``(1, k, 1)``
for a portrait one (the crops run along the long side). Example (example ``gemma3``, pan-and-
scan off): a 112 x 84 image -> ``pixel_values`` [1, 3, 896, 896], 1 tile, 256 tokens, grid (1, 1, 1).

The model's image token is the soft token (``config.image_token_id``), not the processor's
``image_token`` (``<start_of_image>``, the template's per-image placeholder): ``mm_token_ids``
maps images to the soft token. Positions are 1-D and restart per sample. Attention: every run
of soft tokens (one per tile) is a block attended bidirectionally (``image_attention``), which
`train.image_blocks` locates in the row and `train.block_attention` applies. Images only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.gemma3.settings import Gemma3Settings
from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3Layout:
    """Tiles of every image of a row stacked in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False
    #: the model attends both ways inside each image block (the counter records the same)
    image_attention: ClassVar[str] = "bidirectional"

    settings: Gemma3Settings  # shared with the counter
    image_processor: Any
    #: what the processor passes its image processor (``settings.images_kwargs``), plus tensors out
    images_kwargs: dict[str, Any]
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Gemma3Layout:
        """From the loaded processor."""
        settings = Gemma3Settings.from_processor(bundle)
        return cls(
            settings=settings,
            image_processor=bundle.image_processor,
            images_kwargs={**settings.images_kwargs, "return_tensors": "pt"},
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.soft_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([image], **self.images_kwargs, **self.pixel_kwargs)
        pixels = got["pixel_values"]
        crops = int(got["num_crops"][0])
        tiles = int(pixels.shape[0])
        if tiles != 1 + crops:
            raise ValueError(f"the image processor made {tiles} tiles for 1 image + {crops} crops")
        width, height = image.size
        grid = (1, 1, 1) if not crops else ((1, 1, crops) if width >= height else (1, crops, 1))
        return ItemInputs(
            tensors={"pixel_values": pixels},
            grid_thw=grid,
            num_tiles=tiles,
            num_tokens=self.settings.image_seq_length * tiles,
            # the processor knows no patch size: the tower's output tokens stand for its compute
            num_patches=self.settings.image_seq_length * tiles,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("Gemma 3 takes no video (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
