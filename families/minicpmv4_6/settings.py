"""What both MiniCPM-V 4.6 faces read from the processor, derived once: slicing, patch size, token ids.

``MiniCPMV4_6ImageProcessorPil`` reads ``scale_resolution``, ``max_slice_nums``, ``patch_size``,
``slice_mode`` and ``downsample_mode`` from its config (``MiniCPMV4_6Processor.images_kwargs``
sets none of them); ``use_image_id`` is the processor's own when set, else the image
processor's (``MiniCPMV4_6Processor.__call__``). The video processor's settings are its own
(``MiniCPMV4_6Processor.videos_kwargs`` sets none either): the loaded video processor's, or
``video_preprocessor_config.json`` over the class values (`VIDEO_CLASS_DEFAULTS`) without torchvision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings

IMAGE_KEYS = ("scale_resolution", "max_slice_nums", "patch_size", "slice_mode", "downsample_mode", "use_image_id")
#: ``MiniCPMV4_6VideoProcessor``'s class attributes (transformers 5.24), for keys its config leaves out
VIDEO_CLASS_DEFAULTS: dict[str, Any] = {
    "scale_resolution": 448,
    "max_slice_nums": 9,
    "patch_size": 14,
    "slice_mode": True,
    "downsample_mode": "16x",
    "max_num_frames": 128,
    "stack_frames": 1,
    "do_sample_frames": True,
    "do_resize": True,
}
MARKUP = (
    "image_start_token",
    "image_end_token",
    "slice_start_token",
    "slice_end_token",
    "image_id_start_token",
    "image_id_end_token",
)


def merge_factor(downsample_mode: str) -> int:
    """Patches per side merged into one token: 4 in "16x" mode, 2 in "4x" (``find_best_resize``)."""
    return 2 if downsample_mode == "4x" else 4


def patches_per_token(downsample_mode: str) -> int:
    """``MiniCPMV4_6Processor.image_token_divisor`` / ``video_token_divisor``."""
    return merge_factor(downsample_mode) ** 2


class SliceRule(Protocol):
    """What slicing one picture reads: the image and the video settings both hold it."""

    @property
    def scale_resolution(self) -> int: ...
    @property
    def max_slice_nums(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def slice_mode(self) -> bool: ...
    @property
    def merge_factor(self) -> int: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6VideoSettings:
    """``MiniCPMV4_6VideoProcessor``'s settings: every frame (and stacked canvas) is sliced like an image."""

    scale_resolution: int
    max_slice_nums: int
    patch_size: int
    slice_mode: bool
    downsample_mode: str
    max_num_frames: int  # main frames (one a second; a long video's spread over it)
    stack_frames: int  # > 1: that many frames a second, the sub-second ones stacked into one canvas
    do_sample_frames: bool
    do_resize: bool

    @property
    def merge_factor(self) -> int:
        return merge_factor(self.downsample_mode)

    @property
    def patches_per_token(self) -> int:
        return patches_per_token(self.downsample_mode)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MiniCPMV4_6VideoSettings:
        """``config`` (the video processor's dict or file) wins; the class values fill what it leaves out."""
        merged = {**VIDEO_CLASS_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        return cls(
            scale_resolution=int(merged["scale_resolution"]),
            max_slice_nums=int(merged["max_slice_nums"]),
            patch_size=int(merged["patch_size"]),
            slice_mode=bool(merged["slice_mode"]),
            downsample_mode=str(merged["downsample_mode"]),
            max_num_frames=int(merged["max_num_frames"]),
            stack_frames=int(merged["stack_frames"]),
            do_sample_frames=bool(merged["do_sample_frames"]),
            do_resize=bool(merged["do_resize"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MiniCPMV4_6Settings:
    """The processor's settings both faces use (`MiniCPMV4_6Counter`, `MiniCPMV4_6Layout`)."""

    image_token: str  # tokenizer.image_token: the template's placeholder, one per vision token
    image_token_id: int
    video_token_id: int
    markup: dict[str, str]  # image_start_token ... image_id_end_token, as the tokenizer names them
    scale_resolution: int  # side of a slice (and of the source image) in pixels, before rounding
    max_slice_nums: int
    patch_size: int
    slice_mode: bool
    downsample_mode: str  # "16x": ViT window merger + MLP merger (16 patches a token); "4x": MLP only
    use_image_id: bool  # prepend <image_id>k</image_id>, k the image's place in its sample
    video: MiniCPMV4_6VideoSettings

    @property
    def merge_factor(self) -> int:
        return merge_factor(self.downsample_mode)

    @property
    def patches_per_token(self) -> int:
        return patches_per_token(self.downsample_mode)

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> MiniCPMV4_6Settings:
        ip = bundle.image_processor
        if not type(ip).__name__.startswith("MiniCPMV4_6ImageProcessor"):
            raise ProcessorLoadError(
                f"{bundle.source}: MiniCPMV4_6Processor with {type(ip).__name__}; the closed form knows only "
                "MiniCPMV4_6ImageProcessor slicing"
            )
        values = effective_image_settings(bundle, IMAGE_KEYS)
        use_image_id = bundle.processor_config.get("use_image_id")
        tokenizer: Any = bundle.tokenizer
        markup = {name: getattr(tokenizer, name, None) for name in MARKUP}
        missing = [name for name, token in markup.items() if not token]
        if missing or not getattr(tokenizer, "image_token", None):
            raise ProcessorLoadError(f"{bundle.source}: tokenizer names no {', '.join(missing or ['image_token'])}")
        if values["downsample_mode"] not in ("4x", "16x"):
            raise ProcessorLoadError(f"{bundle.source}: downsample_mode {values['downsample_mode']!r} is not 4x or 16x")
        return cls(
            image_token=str(tokenizer.image_token),
            image_token_id=bundle.token_id(str(tokenizer.image_token), "image_token"),
            video_token_id=bundle.token_id(str(tokenizer.video_token), "video_token"),
            markup={name: str(token) for name, token in markup.items()},
            scale_resolution=int(values["scale_resolution"]),
            max_slice_nums=int(values["max_slice_nums"]),
            patch_size=int(values["patch_size"]),
            slice_mode=bool(values["slice_mode"]),
            downsample_mode=str(values["downsample_mode"]),
            use_image_id=bool(values["use_image_id"] if use_image_id is None else use_image_id),
            video=MiniCPMV4_6VideoSettings.from_config(bundle.video_config),
        )
