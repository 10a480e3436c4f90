"""What both Kimi K2.5 faces read from the processor, derived once: the media tokens and the NaViT resize.

``Kimi_K25ImageProcessor`` and ``Kimi_K25VideoProcessor`` exist only as torchvision classes.
Without torchvision `families.processor.load_processor` keeps ``preprocessor_config.json`` as a
settings-only object and ``video_preprocessor_config.json`` as ``bundle.video_config``, so the
counter runs anywhere; the class defaults below fill keys the files leave out (transformers 5.24
``image_processing_kimi_k25.Kimi_K25ImageProcessor``, ``video_processing_kimi_k25.Kimi_K25VideoProcessor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle
from families.settings import effective_image_settings

# Kimi_K25ImageProcessor class attributes, used only for keys the loaded config leaves out.
KIMI_IMAGE_CLASS_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "max_patches": 16384,
    "size": {"max_height": 512, "max_width": 512},
}
# Kimi_K25VideoProcessor class attributes (its fps / do_sample_frames are never read: the dataset's
# VideoSampling is passed at every call, `KimiK25Counter.processor_video_kwargs`).
KIMI_VIDEO_CLASS_DEFAULTS: dict[str, Any] = {
    **KIMI_IMAGE_CLASS_DEFAULTS,
    "max_patches": 4096,
    "temporal_patch_size": 4,
}
IMAGE_TOKEN = "<|media_pad|>"  # Kimi_K25Processor.image_token unless the tokenizer names one
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"  # Kimi_K25Processor.video_token, likewise


def _max_side_patches(size: Any) -> int:
    """``size.max_height`` (patches per side: the processor multiplies it by the patch size)."""
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    height, width = get("max_height"), get("max_width")
    if height is None or height != width:
        raise ValueError(f"Kimi K2.5 image processor size {size!r} needs equal max_height and max_width")
    return int(height)


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiK25VideoSettings:
    """``Kimi_K25VideoProcessor``'s settings: the NaViT resize of each frame and the chunk length."""

    patch_size: int  # 14 px
    merge_size: int  # 2: each chunk spends one frame's (gh / 2)(gw / 2) tokens
    max_patches: int  # patch budget of one frame before padding (4096)
    max_side_patches: int  # size.max_height (512)
    temporal_patch_size: int  # frames per chunk (4); the last chunk may hold fewer

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KimiK25VideoSettings:
        """``config`` (the video processor's, loaded or read as JSON) wins over the class defaults."""
        names = tuple(KIMI_VIDEO_CLASS_DEFAULTS)
        merged = {k: KIMI_VIDEO_CLASS_DEFAULTS[k] if config.get(k) is None else config[k] for k in names}
        return cls(
            patch_size=int(merged["patch_size"]),
            merge_size=int(merged["merge_size"]),
            max_patches=int(merged["max_patches"]),
            max_side_patches=_max_side_patches(merged["size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
        )

    @property
    def factor(self) -> int:
        """Pixels a side of one token (patch x merge): padded frame sides are multiples of it."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiK25Settings:
    """The processor's settings both faces use (`KimiK25Counter`, `KimiK25Layout`)."""

    image_token_id: int  # <|media_pad|>: each stands for merge x merge patches
    patch_size: int  # 14 px
    merge_size: int  # 2: the 2x2 patch merger
    max_patches: int  # total patch budget before padding (16384)
    max_side_patches: int  # patches a side may span (size.max_height, 512)
    video_token_id: int  # <|kimi_k25_video_placeholder|>: each stands for one chunk's merge x merge patches
    video: KimiK25VideoSettings

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> KimiK25Settings:
        names = tuple(KIMI_IMAGE_CLASS_DEFAULTS)
        found = effective_image_settings(bundle, names)
        merged = {k: KIMI_IMAGE_CLASS_DEFAULTS[k] if found.get(k) is None else found[k] for k in names}
        return cls(
            image_token_id=bundle.token_id(IMAGE_TOKEN, "image_token"),
            patch_size=int(merged["patch_size"]),
            merge_size=int(merged["merge_size"]),
            max_patches=int(merged["max_patches"]),
            max_side_patches=_max_side_patches(merged["size"]),
            video_token_id=bundle.token_id(VIDEO_TOKEN, "video_token"),
            # no video_preprocessor_config.json: transformers builds the video processor from
            # preprocessor_config.json, which `load_processor` keeps as image_config without torchvision
            video=KimiK25VideoSettings.from_config(bundle.video_config or bundle.image_config or {}),
        )

    @property
    def factor(self) -> int:
        """Pixels a side of one ``<|media_pad|>`` token (patch x merge): padded sides are multiples of it."""
        return self.patch_size * self.merge_size
