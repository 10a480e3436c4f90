"""Kimi K2.5 VL: NaViT patches of each image, concatenated; 1-D positions restarting per sample.

``Kimi_K25ImageProcessor`` (torchvision) resizes and zero-pads each image to multiples of 28 px
(`families.kimi_k25.counter`), then cuts it into 14 x 14 patches: ``pixel_values``
[gh * gw, 3, 14, 14] and ``image_grid_thw`` [1, 3] = (1, gh, gw). Padding is added *before*
rescale / normalize, so the padded pixels are real inputs of the model (0 -> -1.0), which the
8-bit path (`RAW_PIXELS`, `train.pixels`) reproduces by table lookup. Joined ``cat`` in token
order across items, samples and packs.

What keeps a packed row equal to its samples alone (``tests/train/families/test_kimi_k25.py``):

- MoonViT attends within each image (``cu_seqlens`` from ``image_grid_thw``; the non-flash path
  splits q/k/v per image), its position embedding and 2-D rope are per image, and the 2x2
  merger and projector are per token: images of different samples never mix.
- The DeepSeek-V3 decoder (MLA) uses plain 1-D rotary positions: ``rope = "text"`` restarts them
  per sample and the document mask keeps samples apart.
- MoE routing is per token (sigmoid scores + ``e_score_correction_bias``, group top-k per token);
  transformers' DeepSeek-V3 computes no auxiliary or sequence-level balance loss (the output's
  ``router_logits`` are only recorded on request and never enter ``loss``), so nothing sums over
  the row.

Videos (``Kimi_K25VideoProcessor``, torchvision; called on the frames `prep tokenize` sampled,
``do_sample_frames=False``): chunks of 4 frames, each frame resized and padded like an image with
the video budget, ``pixel_values_videos`` [frames * gh * gw, 3, 14, 14] and one
``video_grid_thw`` row (frames in the chunk, gh, gw) per chunk, joined ``cat`` like images. The
vision tower treats each chunk as one clip: attention within the chunk (``cu_seqlens`` with
``merge_temporal=True``: t * h * w patches), a per-frame sinusoid added to the patches, then the
chunk's frames averaged into gh gw patches (``temporal_merge``, per grid row) before the 2x2
merger: nothing crosses a chunk, so nothing crosses a sample. Each chunk fills gh gw / 4
``<|kimi_k25_video_placeholder|>`` tokens in order. The item's plan is (chunks, gh, gw).

Example (Kimi-K2.5 settings): a 100 x 60 (w x h) image is not resized (scale 1), padded to
84 x 112 (h x w) -> grid (1, 6, 8), 48 patches, 12 ``<|media_pad|>``. A 10-frame 96 x 64 video:
chunks of 4, 4, 2 frames, ``video_grid_thw`` [[4, 6, 8], [4, 6, 8], [2, 6, 8]], plan (3, 6, 8),
36 placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from families.kimi_k25.settings import KimiK25Settings
from families.layout import IMAGE, RAW_PIXELS, VIDEO, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.processor import ProcessorBundle
from packvlm.errors import ResourceError


class TorchvisionNeededError(ResourceError):
    """Kimi K2.5's image processor is a torchvision class: training its images needs torchvision."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiK25Layout:
    """Each image's patches and grid, concatenated in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {
        "pixel_values": "cat",
        "image_grid_thw": "cat",
        "pixel_values_videos": "cat",
        "video_grid_thw": "cat",
    }
    rope: ClassVar[Rope] = "text"

    settings: KimiK25Settings  # shared with the counter
    image_processor: Any
    video_processor: Any | None  # Kimi_K25VideoProcessor (torchvision, as the image processor)
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> KimiK25Layout:
        """From the loaded processor (its image processor is a torchvision class)."""
        if not callable(bundle.image_processor):  # the settings-only stand-in `load_processor` keeps without it
            raise TorchvisionNeededError(
                f"{bundle.source}: Kimi K2.5 images need torchvision at train time (Kimi_K25ImageProcessor is a "
                "torchvision class); install torch with its matching torchvision"
            )
        return cls(
            settings=KimiK25Settings.from_processor(bundle),
            image_processor=bundle.image_processor,
            video_processor=getattr(bundle.processor, "video_processor", None),
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id, VIDEO: self.settings.video_token_id}

    @property
    def supports_video(self) -> bool:
        return self.video_processor is not None

    @property
    def no_video_reason(self) -> str:
        """What `train.media` says when a video arrives without a video processor."""
        return "the processor directory built no Kimi_K25VideoProcessor (video_preprocessor_config.json missing?)"

    def _item(self, image: Image.Image) -> ItemInputs:
        got = self.image_processor(images=[image], return_tensors="pt", **self.pixel_kwargs)
        grid = got["image_grid_thw"].to(torch.int64).reshape(1, 3)
        grid_t, grid_h, grid_w = (int(v) for v in grid[0].tolist())
        return ItemInputs(
            tensors={"pixel_values": got["pixel_values"], "image_grid_thw": grid},
            grid_thw=(grid_t, grid_h, grid_w),
            num_tiles=1,
            num_tokens=grid_h * grid_w // self.settings.merge_size**2,
            num_patches=grid_t * grid_h * grid_w,
        )

    def _video(self, video: DecodedVideo) -> ItemInputs:
        if self.video_processor is None:
            raise TypeError("no Kimi K2.5 video processor (train.media checks supports_video first)")
        got = self.video_processor(videos=[video.frames], do_sample_frames=False, return_tensors="pt")
        grid = got["video_grid_thw"].to(torch.int64).reshape(-1, 3)  # one row per chunk
        _, grid_h, grid_w = (int(v) for v in grid[0].tolist())
        chunks = grid.shape[0]
        return ItemInputs(
            tensors={"pixel_values_videos": got["pixel_values_videos"], "video_grid_thw": grid},
            grid_thw=(chunks, grid_h, grid_w),
            num_tiles=chunks,
            num_tokens=chunks * grid_h * grid_w // self.settings.video.merge_size**2,
            num_patches=int(grid.prod(dim=1).sum()),
        )

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        return SampleInputs(items=(*(self._item(image) for image in images), *(self._video(v) for v in videos)))
