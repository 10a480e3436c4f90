"""Gemma 4 (``Gemma4Processor``): one padded patch sequence per image, soft tokens per its size.

The image processor (``Gemma4ImageProcessorPil``) resizes each image (`families.gemma4.settings`),
patchifies it into 16 px patches (channels last inside a patch) and pads the sequence to
``max_soft_tokens * 9`` patches: ``pixel_values`` [1, max_patches, 768] and
``image_position_ids`` [1, max_patches, 2] (x, y of each patch, -1 on padding). Every image of
one processor has the same padded length, so items, samples and packs join ``cat``; the vision
tower encodes each image alone (its own bidirectional mask over its real patches) and drops the
padding, and the model scatters the pooled soft tokens into the runs of ``<|image|>`` in order.

What the plan is checked against, in `families.gemma4.counter`'s convention: one tile,
``num_tokens`` = ``num_soft_tokens_per_image``, grid (1, rows, cols) of soft tokens (the real
patch grid over 3). Example (example ``gemma4``): a 90 x 60 image -> resized 768 x 528 (w x h)
-> 33 x 48 patches, grid (1, 11, 16), 176 tokens, ``pixel_values`` [1, 2520, 768].

Pixels leave the workers as 8-bit values (``pixel_kwargs`` = `RAW_PIXELS`: the processor
resizes in 8 bits, then rescales; with that off its patch rows are the resized image's bytes).
``pixel_rows`` declares the rows for `train.pixels`: channel last within a 16 x 16 x 3 row,
padding rows where ``image_position_ids`` is -1 (0.0 in the processor's floats).

Attention: with ``use_bidirectional_attention: "vision"`` the model attends both ways inside each
image's run of soft tokens on its *sliding* layers only (``create_masks_for_vision_model``:
full layers causal), which `train.block_attention` applies per sample (``image_attention``,
the rule's layers from the model config). Positions are 1-D and restart per sample. Images only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.gemma4.settings import Gemma4Settings
from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, PatchRows, Rope, SampleInputs
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4Layout:
    """Padded patch sequences of every image of a row stacked in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {"pixel_values": "cat", "image_position_ids": "cat"}
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False
    #: image blocks attended both ways (on sliding layers; the counter records the same)
    image_attention: ClassVar[str] = "bidirectional"

    settings: Gemma4Settings  # shared with the counter
    image_processor: Any
    images_kwargs: dict[str, Any]  # the processor call's image kwargs, plus tensors out
    image_token_id: int  # <|image|>: the model's config.image_token_id
    pixel_rows: PatchRows  # how pixel_values hold patches (module docstring)
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Gemma4Layout:
        """From the loaded processor."""
        settings = Gemma4Settings.from_processor(bundle)
        return cls(
            settings=settings,
            image_processor=bundle.image_processor,
            images_kwargs={**settings.images_kwargs, "return_tensors": "pt"},
            image_token_id=bundle.token_id("<|image|>", "image_token"),
            pixel_rows=PatchRows(
                patch_size=settings.patch_size,
                channel_order="last",
                padding_keyword="image_position_ids",
                padding_value=-1,
            ),
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([image], **{**self.images_kwargs, **self.pixel_kwargs})
        positions = got["image_position_ids"]
        real = (positions[0] >= 0).all(dim=-1)
        cols = int(positions[0, real, 0].max()) + 1
        rows = int(positions[0, real, 1].max()) + 1
        k = self.settings.pooling_kernel_size
        tokens = int(got["num_soft_tokens_per_image"][0])
        if rows % k or cols % k or (rows // k) * (cols // k) != tokens:
            raise ValueError(f"the image processor made a {rows} x {cols} patch grid for {tokens} soft tokens")
        return ItemInputs(
            tensors={"pixel_values": got["pixel_values"], "image_position_ids": positions},
            grid_thw=(1, rows // k, cols // k),
            num_tiles=1,
            num_tokens=tokens,
            num_patches=rows * cols,
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("Gemma 4 takes no video here (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
