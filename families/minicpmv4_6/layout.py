"""MiniCPM-V 4.6 (``MiniCPMV4_6Processor`` + ``MiniCPMV4_6ImageProcessorPil``): NaViT-packed slices.

The image processor returns, per image, the source image then its slices (row-major), each
patchified to ``[C, P, h*w*P]`` and concatenated along the last dim: ``pixel_values``
``[1, C, P, patches * P]`` and ``target_sizes`` ``[1 + slices, 2]`` (each piece's (h, w) in
patches). ``MiniCPMV4_6ForConditionalGeneration`` takes every image of the row that way
(``pixel_values`` joined ``cat_last``, ``target_sizes`` ``cat``): its vision tower splits the
pieces by ``target_sizes`` (``cu_seqlens``: a piece attends only to itself, also in the 2x2
window merger), and the merged features of every piece, in order, replace the
``<|image_pad|>`` tokens: (h*w)/16 per piece in "16x" mode, /4 in "4x".

What the plan is checked against, in the counter's convention (`families.minicpmv4_6.counter`):
grid ``(1, rows, cols)`` of the slices (``(1, 0, 0)`` unsliced), ``1 + rows*cols`` tiles, and the
summed tokens. Example: 1000x300 -> target_sizes [[16, 60], [32, 32] x 3], grid (1, 1, 3),
4 tiles, 60 + 3 * 64 = 252 tokens, 2,032 patches. Positions restart per sample (the Qwen3.5
decoder's text rope: MiniCPM-V gives no image its own rope positions); the decoder's gated
delta-net layers reset per sample (`train.linear_attention`). Images only: video needs the
torchvision video processor and has no closed-form count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.minicpmv4_6.settings import MiniCPMV4_6Settings
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6Layout:
    """Source image and slices of every image, concatenated in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat_last", "target_sizes": "cat"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False

    settings: MiniCPMV4_6Settings  # shared with the counter
    image_processor: Any
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> MiniCPMV4_6Layout:
        return cls(settings=MiniCPMV4_6Settings.from_processor(bundle), image_processor=bundle.image_processor)

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        s = self.settings
        got = self.image_processor(
            images=[image],
            scale_resolution=s.scale_resolution,
            max_slice_nums=s.max_slice_nums,
            patch_size=s.patch_size,
            slice_mode=s.slice_mode,
            downsample_mode=s.downsample_mode,
            return_tensors="pt",
            **self.pixel_kwargs,
        )
        pixels, sizes = got["pixel_values"], got["target_sizes"]  # int32, as the processor gives it
        rows, cols = (int(v) for v in got["grids"][0])
        pieces = int(got["num_patches_per_image"][0])
        areas = sizes[:, 0].long() * sizes[:, 1].long()
        patches = int(areas.sum())
        if pieces != sizes.shape[0] or pieces != 1 + rows * cols or pixels.shape[-1] != patches * s.patch_size:
            raise ValueError(f"image processor made {pieces} pieces, target_sizes {sizes.tolist()}, grid {rows}x{cols}")
        return ItemInputs(
            tensors={"pixel_values": pixels, "target_sizes": sizes},
            grid_thw=(1, rows, cols),
            num_tiles=pieces,
            num_tokens=int((areas // s.patches_per_token).sum()),
            num_patches=patches,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("MiniCPM-V 4.6 video is not trained here (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
