"""LLaVA-NeXT (``LlavaNextProcessor``) and LLaVA-OneVision (``LlavaOnevisionProcessor``): anyres tiles.

The processor cuts each image into a whole-image tile plus rows x cols tiles of the best
``image_grid_pinpoints`` resolution and returns, for a batch of images,
``pixel_values`` [N, tiles_max, 3, S, S] (zero tiles after an image's own ``1 + rows*cols``),
``image_sizes`` [N, 2] (height, width before resizing) and, OneVision only,
``batch_num_images``. The model re-derives every image's tile count from ``image_sizes``
(``image_size_to_num_patches``) and drops the zero tiles, so a packed row is the images of
all its samples in token order: ``pixel_values`` zero-padded to the row's largest tile count
(``pad_cat``), ``image_sizes`` and ``batch_num_images`` concatenated. Positions are 1-D,
restarting per sample.

``batch_num_images`` (OneVision) is per image, not per sample: packvlm hands the processor a
sample's images as a flat list (`prep.tokenize.processor_path`), which the image processor
reads as one batch entry per image, ``[1] * n``; every image is then tiled, as `prep tokenize`
counted it (``LlavaCounter.count_image`` without ``multi_image``). The model's rule
``need_patching = [n == 1 for n in batch_num_images for _ in range(n)]`` therefore tiles every
image of the row exactly as for its sample alone. A per-sample count (``[2]`` for a
two-image sample, the nested-list convention) would embed that sample's images as one
untiled square each: a different sequence, and a placeholder-count error.

Each image goes through the family's **own** processor alone (``processor(text="<image>",
images=[image])``): its ``pixel_values`` / ``image_sizes`` / ``batch_num_images`` are what the
processor gives for that image inside its sample (flat-list images are processed
independently; only the batch padding differs), its number of ``<image>`` ids is the
placeholder count, and the tile grid is the processor's own ``select_best_resolution`` of
``image_sizes`` over its pinpoints divided by the tile side read from ``pixel_values``
(``_get_number_of_features``' scale): grid (1, rows, cols), tiles ``pixel_values.shape[1]``,
as `families.llava.counter` stores them.

Example (the OneVision example processor: 384 px tiles, 729 features per tile): a 560x40
image gives ``pixel_values`` [1, 3, 3, 384, 384] (whole image + 1x2 tiles), ``image_sizes``
[[40, 560]], 894 ``<image>`` ids; with a 40x820 image (1 + 3x1 tiles) in the same row the
row's ``pixel_values`` is [2, 4, 3, 384, 384], the first image's fourth tile zero.

Videos (OneVision) are not laid out here: its video processor needs torchvision, and without
it `train.media` stops on a video with `VideoProcessorUnavailable` naming the sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image
from transformers.image_processing_utils import select_best_resolution

from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.llava.settings import LlavaSettings
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class LlavaLayout:
    """Anyres images, one processor call per image; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {
        "pixel_values": "pad_cat",  # [1, tiles, 3, S, S] per image -> [N, tiles_max, 3, S, S]
        "image_sizes": "cat",
        "batch_num_images": "cat",
    }
    rope: ClassVar[Rope] = "text"

    settings: LlavaSettings  # shared with the counter
    processor: Any  # the whole processor: its image-token expansion is the placeholder count
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> LlavaLayout:
        """From the loaded processor (the processor must be buildable here)."""
        return cls(settings=LlavaSettings.from_processor(bundle), processor=bundle.processor)

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    @property
    def supports_video(self) -> bool:
        return False

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.processor(
            text=[self.processor.image_token], images=[image], return_tensors="pt", **self.pixel_kwargs
        )
        pixels = got["pixel_values"]  # [1, tiles, 3, th, tw]: one image, no batch padding
        height, width = (int(x) for x in got["image_sizes"][0].tolist())
        best_h, best_w = select_best_resolution((height, width), [list(p) for p in self.settings.tiles.pinpoints])
        tile_h, tile_w = int(pixels.shape[-2]), int(pixels.shape[-1])
        tensors = {"pixel_values": pixels, "image_sizes": got["image_sizes"].to(torch.int64)}
        if "batch_num_images" in got:
            tensors["batch_num_images"] = got["batch_num_images"].to(torch.int64)
        num_tiles = int(pixels.shape[1])
        return ItemInputs(
            tensors=tensors,
            grid_thw=(1, best_h // tile_h, best_w // tile_w),
            num_tiles=num_tiles,
            num_tokens=int((got["input_ids"] == self.settings.image_token_id).sum()),
            num_patches=num_tiles * self.settings.feature_rows * self.settings.feature_cols,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("no LLaVA video layout (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
