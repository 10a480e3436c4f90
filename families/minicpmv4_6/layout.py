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
delta-net layers reset per sample (`train.linear_attention`).

Videos (torchvision: ``MiniCPMV4_6VideoProcessor``) come the same way: ``pixel_values_videos``
``[1, C, P, patches * P]`` and ``target_sizes_videos`` (one row per piece of every unit: frame or
stacked canvas, then its slices), joined like the images' and encoded by the same tower
(``get_video_features``); their features replace the ``<|video_pad|>`` tokens. The frames are
those `prep tokenize` planned (`families.minicpmv4_6.counter.VideoPlan.frame_indices`, decoded
by `train.media` as transformers' PyAV reader does), passed with ``do_sample_frames=False`` and the
container's metadata, so ``_preprocess`` makes the units the counter counted. Only with
``stack_frames`` 1 (the checkpoint's): with k > 1 ``_preprocess`` also reads ``max_num_frames``
(the sampling's, which a pack does not record), so such video is refused (``no_video_reason``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from PIL import Image

from families.layout import IMAGE, RAW_PIXELS, VIDEO, DecodedVideo, ItemInputs, Join, Rope, SampleInputs
from families.minicpmv4_6.settings import MiniCPMV4_6Settings
from families.processor import ProcessorBundle


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6Layout:
    """Source image and slices of every image, concatenated in token order; see the module docstring."""

    joins: ClassVar[Mapping[str, Join]] = {
        "pixel_values": "cat_last",
        "target_sizes": "cat",
        "pixel_values_videos": "cat_last",
        "target_sizes_videos": "cat",
    }
    rope: ClassVar[Rope] = "text"

    settings: MiniCPMV4_6Settings  # shared with the counter
    image_processor: Any
    video_processor: Any | None = None  # None where torchvision is missing
    #: passed to every image-processor call: `families.layout.RAW_PIXELS` (8-bit out) or {} (the float inputs)
    pixel_kwargs: Mapping[str, bool] = field(default_factory=lambda: RAW_PIXELS)

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> MiniCPMV4_6Layout:
        processor = bundle.processor
        return cls(
            settings=MiniCPMV4_6Settings.from_processor(bundle),
            image_processor=bundle.image_processor,
            video_processor=getattr(processor, "video_processor", None) if processor is not None else None,
        )

    @property
    def mm_token_ids(self) -> Mapping[int, int]:
        return {IMAGE: self.settings.image_token_id, VIDEO: self.settings.video_token_id}

    @property
    def supports_video(self) -> bool:
        return self.video_processor is not None and self.settings.video.stack_frames <= 1

    @property
    def missing_video_package(self) -> str | None:
        """The package whose absence leaves no video processor (`train.media` exits 3 naming it)."""
        return "torchvision" if self.video_processor is None else None

    @property
    def no_video_reason(self) -> str:
        """What `train.media` says when a video arrives and ``supports_video`` is False."""
        if self.video_processor is None:
            return (
                "the model's video processor could not be loaded (HF video processors need torchvision): "
                "`pip install torchvision` matching your torch, or train on image/text-only data"
            )
        return (
            f"stack_frames {self.settings.video.stack_frames} > 1: the video processor's canvases depend on the "
            "sampling's max_num_frames, which the pack does not record; train with stack_frames 1"
        )

    def _item(self, got: Mapping[str, Any], suffix: str) -> ItemInputs:
        """One image's or video's processor output: pieces checked against their grids, then counted."""
        s = self.settings
        pixels, sizes = got[f"pixel_values{suffix}"], got[f"target_sizes{suffix}"]  # int32 sizes, as given
        grids = [(int(r), int(c)) for r, c in got[f"grids{suffix}"]]
        pieces = sum(1 + r * c for r, c in grids)
        areas = sizes[:, 0].long() * sizes[:, 1].long()
        patches = int(areas.sum())
        if pieces != sizes.shape[0] or pixels.shape[-1] != patches * s.patch_size:
            raise ValueError(f"processor made {sizes.shape[0]} pieces for grids {grids}, target_sizes {sizes.tolist()}")
        return ItemInputs(
            tensors={f"pixel_values{suffix}": pixels, f"target_sizes{suffix}": sizes},
            grid_thw=(len(grids), *grids[0]),
            num_tiles=pieces,
            num_tokens=int((areas // s.patches_per_token).sum()),
            num_patches=patches,
        )

    def _image(self, image: Image.Image) -> ItemInputs:
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
        if int(got["num_patches_per_image"][0]) != got["target_sizes"].shape[0]:
            raise ValueError(f"image processor made {got['num_patches_per_image']} pieces, {got['target_sizes']}")
        return self._item(got, "")

    def _video(self, video: DecodedVideo) -> ItemInputs:
        from transformers.video_utils import VideoMetadata

        if self.video_processor is None or self.settings.video.stack_frames > 1:
            raise TypeError(f"MiniCPM-V 4.6 video is not trained here: {self.no_video_reason}")
        height, width = video.frames.shape[1:3]
        # the container's fields, as transformers' PyAV reader sets them; with stack_frames 1 the
        # video processor reads none of them past frame sampling, which is off
        metadata = VideoMetadata(
            total_num_frames=video.total_frames,
            fps=video.fps,
            duration=video.total_frames / video.fps,
            height=height,
            width=width,
        )
        got = self.video_processor(
            videos=[video.frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt"
        )
        item = self._item(got, "_videos")
        if got["num_frames_per_video"][0] != item.grid_thw[0]:
            raise ValueError(f"video processor made {got['num_frames_per_video']} units for {item.grid_thw[0]} grids")
        return item

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        return SampleInputs(items=(*(self._image(image) for image in images), *(self._video(v) for v in videos)))
