"""LFM2-VL (``Lfm2VlProcessor``): SigLIP2 NaFlex patches per tile, LFM2 short convs reset per sample.

The image processor turns an image into ``num_tiles`` encoder inputs (the tiles of a large
image plus its thumbnail, or one resized image; `families.lfm2_vl.counter`), each flattened
to patches and zero-padded to ``max_num_patches`` rows: ``pixel_values`` [tiles, N, 3 p^2]
(channels last within a patch), ``pixel_attention_mask`` [tiles, N] (1 = a real patch) and
``spatial_shapes`` [tiles, 2] (patch rows and columns). All three join by ``cat`` along the
tile dimension in token order (N is the same for every input of one processor), and the model
scatters each input's ``(h/2)(w/2)`` projected tokens into the ``<image>`` slots in that order.
Positions: 1-D, restarting per sample (LFM2 uses plain rope).

Pixels leave the workers as 8-bit values (``pixel_kwargs`` = `RAW_PIXELS`: the processor
resizes and tiles in 8 bits, then runs its fused rescale + normalize; with that off its patch
rows are the tiles' bytes). ``pixel_rows`` declares the rows for `train.pixels`: channel last
within a p x p x 3 row, padding rows where ``pixel_attention_mask`` is 0 (0.0 in the
processor's floats, where a looked-up 0 would be -1.0).

The text model mixes tokens outside attention: every ``conv`` layer runs a causal depthwise
convolution of ``conv_L_cache`` taps, which over a packed row would carry the last taps of one
sample into the next. `train.linear_attention` hooks ``causal_conv1d_fn`` of transformers'
LFM2 modeling module, so with the row's ``cu_seq_lens_q`` each sample's conv starts from zeros
(`train.attention.prepare_model_for_packing` installs it for every model).

Example (LFM2-VL-450M settings): a 1024x768 image -> 6 tiles of 32 x 32 patches:
``pixel_values`` [6, 1024, 768], ``spatial_shapes`` [[32, 32]] x 6, 1536 tokens, grid (1, 2, 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, DecodedVideo, ItemInputs, Join, PatchRows, Rope, SampleInputs
from families.lfm2_vl.settings import Lfm2VlSettings
from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import merged_images_kwargs

KEYS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")


@dataclass(frozen=True, kw_only=True, slots=True)
class Lfm2VlLayout:
    """Encoder inputs of all images of a row along dim 0, in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = dict.fromkeys(KEYS, "cat")
    rope: ClassVar[Rope] = "text"
    supports_video: ClassVar[bool] = False  # the processor takes no video

    settings: Lfm2VlSettings  # shared with the counter
    image_processor: Any
    images_kwargs: dict[str, Any]  # what the processor passes its image processor, plus tensors
    pixel_rows: PatchRows  # how pixel_values hold patches (module docstring)
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Lfm2VlLayout:
        """From the loaded processor (its torchvision image processor: training needs torchvision)."""
        if type(bundle.image_processor).__name__ != "Lfm2VlImageProcessor":
            raise ProcessorLoadError(
                f"{bundle.source}: LFM2-VL's image processor is torchvision-only and could not be built here "
                f"({type(bundle.image_processor).__name__}); install torchvision to train this family"
            )
        settings = Lfm2VlSettings.from_processor(bundle)
        return cls(
            settings=settings,
            image_processor=bundle.image_processor,
            images_kwargs={**merged_images_kwargs(bundle), "return_tensors": "pt"},
            pixel_rows=PatchRows(
                patch_size=settings.encoder_patch_size,
                channel_order="last",
                padding_keyword="pixel_attention_mask",
                padding_value=0,
            ),
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id}

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor([[image]], **{**self.images_kwargs, **self.pixel_kwargs})
        rows, cols = int(got["image_rows"][0]), int(got["image_cols"][0])
        shapes = got["spatial_shapes"]
        d = self.settings.downsample_factor
        return ItemInputs(
            tensors={k: got[k] for k in KEYS},
            grid_thw=(1, rows, cols),
            num_tiles=int(got["pixel_values"].shape[0]),
            num_tokens=int(((shapes[:, 0] // d) * (shapes[:, 1] // d)).sum()),  # what the projector makes
            num_patches=int(got["pixel_attention_mask"].sum()),
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        if videos:
            raise TypeError("no video layout for LFM2-VL (train.media checks supports_video first)")
        return SampleInputs(items=tuple(self._item(image) for image in images))
