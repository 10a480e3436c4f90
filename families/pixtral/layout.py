"""Pixtral (LLaVA with a Pixtral tower) and Mistral 3 / Ministral 3: whole images, sizes beside them.

``PixtralProcessor`` (transformers serves ``mistral3`` with it too) resizes each image to
``rows * P`` x ``cols * P`` pixels, P = ``patch_size * spatial_merge_size`` (its
``_process_images`` hands that product to the image processor as the patch), and returns
``pixel_values`` [N, 3, H_max, W_max] zero-padded to the largest image of the call, with
``image_sizes`` [N, 2] the real (height, width) of each. The Pixtral vision tower crops every
image back to its ``image_sizes`` before the first layer (``patch_embeds[..., :h/p, :w/p]``)
and attends per image (block-diagonal mask), and Mistral 3's patch merger splits by the same
sizes, so padding never reaches the model and images of different samples and packs can
share one padded tensor. Per item: ``pixel_values`` [1, 3, h, w], ``image_sizes`` [1, 2];
joined ``pad_cat`` / ``cat`` in token order.

What the plan is checked against, in the Pixtral counter's convention
(`families.pixtral.counter`): grid ``(1, rows * merge, cols * merge)`` (vision
patches before the merge), ``rows * cols`` ``[IMG]`` tokens (the ``[IMG_BREAK]`` / ``[IMG_END]``
ids of the expansion are text), one tile. Example (Mistral 3, patch 14, merge 2): a 112 x 84
image stays 112 x 84 = 4 x 3 cells of 28 px -> ``image_sizes`` [84, 112], grid (1, 6, 8),
12 tokens, 48 patches through the tower. Positions restart per sample (1-D rotary). Images
only: these processors take no video.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.pixtral.settings import PixtralSettings
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class PixtralLayout:
    """Whole images zero-padded to the largest, with their real sizes; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "pad_cat", "image_sizes": "cat"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False

    settings: PixtralSettings  # shared with the counter
    image_processor: Any
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> PixtralLayout:
        """From the loaded processor."""
        return cls(settings=PixtralSettings.from_processor(bundle), image_processor=bundle.image_processor)

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    @property
    def cell(self) -> int:
        """Pixels per side of one ``[IMG]`` token: what the processor passes as the patch size."""
        return self.settings.cell

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor(images=[image], patch_size=self.cell, return_tensors="pt", **self.pixel_kwargs)
        sizes = got["image_sizes"].to(torch.int64).reshape(1, 2)
        height, width = (int(v) for v in sizes[0].tolist())
        rows, cols = height // self.cell, width // self.cell
        return ItemInputs(
            tensors={"pixel_values": got["pixel_values"], "image_sizes": sizes},
            grid_thw=(1, rows * self.settings.merge_size, cols * self.settings.merge_size),
            num_tiles=1,
            num_tokens=rows * cols,
            num_patches=rows * cols * self.settings.merge_size**2,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("Pixtral / Mistral 3 take no video (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
