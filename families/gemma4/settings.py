"""What both Gemma 4 faces read from the processor, derived once: the soft-token budget and its grid.

``Gemma4ImageProcessorPil`` resizes every image, keeping its aspect ratio, to the largest size
whose sides are multiples of ``pooling_kernel_size * patch_size`` (3 x 16 = 48 px) and whose
16 px patches number at most ``max_soft_tokens * pooling_kernel_size**2``; the vision tower
pools 3 x 3 patches into one soft token. ``Gemma4Processor`` declares no image defaults of its
own, so the call passes ``preprocessor_config.json``'s values (`families.settings`).

``Gemma4VideoProcessor`` resizes every frame by the same rule at its own budget
(``max_soft_tokens`` 70 in the checkpoints) and samples frames with transformers'
``default_sample_indices_fn`` (`Gemma4VideoSettings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings, merged_images_kwargs

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # image_processing_pil_gemma4._SUPPORTED_SOFT_TOKENS
KEYS = ("max_soft_tokens", "patch_size", "pooling_kernel_size", "do_resize")


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4Settings:
    """The processor's settings both faces use (`Gemma4Counter`, `Gemma4Layout`)."""

    images_kwargs: dict[str, Any]  # what the processor passes its image processor
    max_soft_tokens: int  # the budget: one of SUPPORTED_SOFT_TOKENS
    patch_size: int  # 16
    pooling_kernel_size: int  # 3: soft tokens are pooling_kernel_size**2 patches

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Gemma4Settings:
        merged = merged_images_kwargs(bundle)
        values = effective_image_settings(bundle, KEYS, merged)
        if values["do_resize"] is False:
            raise ProcessorLoadError(
                f"{bundle.source}: do_resize is false, so images keep their own size and are not counted in closed "
                "form; set do_resize true (every released Gemma 4 checkpoint does)"
            )
        missing = [k for k in KEYS[:3] if values[k] is None]
        if missing:
            raise ProcessorLoadError(f"{bundle.source}: the Gemma 4 image processor has no {', '.join(missing)}")
        budget = int(values["max_soft_tokens"])
        if budget not in SUPPORTED_SOFT_TOKENS:
            raise ProcessorLoadError(f"{bundle.source}: max_soft_tokens {budget} is not one of {SUPPORTED_SOFT_TOKENS}")
        return cls(
            images_kwargs=merged,
            max_soft_tokens=budget,
            patch_size=int(values["patch_size"]),
            pooling_kernel_size=int(values["pooling_kernel_size"]),
        )

    @property
    def side_multiple(self) -> int:
        """Resized sides are multiples of this (48 px): one soft token per side step."""
        return self.pooling_kernel_size * self.patch_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes to (`aspect_preserving_size`)."""
        return aspect_preserving_size(width, height, self.max_soft_tokens, self.patch_size, self.pooling_kernel_size)

    def soft_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of soft tokens of an image: its resized sides over 48 px."""
        target_h, target_w = self.resized(width, height)
        return target_h // self.side_multiple, target_w // self.side_multiple


def aspect_preserving_size(
    width: int, height: int, max_soft_tokens: int, patch_size: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """(height, width) an image or video frame resizes to: ``get_aspect_ratio_preserving_size``.

    The same float operations in the same order as transformers 5.24
    (``image_processing_pil_gemma4`` / ``video_processing_gemma4.get_aspect_ratio_preserving_size``),
    so the floors agree bit for bit. Example (budget 280): 640 x 480 -> factor
    sqrt(645120 / 307200) = 1.449, ideal 695.6 x 927.5 -> 672 x 912 px (h x w), 14 x 19 = 266
    soft tokens; at the video budget 70: 336 x 432, 7 x 9 = 63 per frame.
    """
    max_patches = max_soft_tokens * pooling_kernel_size**2
    target_px = max_patches * (patch_size**2)
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    target_h = int(math.floor(factor * height / side)) * side
    target_w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling_kernel_size**2) * side
    if target_h == 0 and target_w == 0:  # cannot happen: ideal_h * ideal_w = target_px >= 70 x 48^2
        raise ValueError(f"image of size {width}x{height} resizes to 0 x 0")
    if target_h == 0:
        target_h, target_w = side, min(int(math.floor(width / height)) * side, longest)
    elif target_w == 0:
        target_w, target_h = side, min(int(math.floor(height / width)) * side, longest)
    return target_h, target_w


#: ``Gemma4VideoProcessor``'s class attributes (transformers 5.24) for keys a video config leaves out;
#: google/gemma-4-31B-it's ``processor_config.json`` video section sets the same values
VIDEO_CLASS_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "max_soft_tokens": 70,
    "pooling_kernel_size": 3,
    "num_frames": 32,
    "do_sample_frames": True,
    "do_resize": True,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4VideoSettings:
    """``Gemma4VideoProcessor``'s settings the counter reads: its frame budget and its sampler.

    Frames are sampled by ``BaseVideoProcessor.sample_frames`` (``default_sample_indices_fn``):
    the instance's ``num_frames`` wins over any ``fps`` (32 in the checkpoints: uniform
    ``arange(k) * T // k``, an error when T < k); only a config with ``num_frames`` null samples
    by fps (``max(1, int(T / fps_src * fps))`` frames the same way).
    """

    max_soft_tokens: int
    patch_size: int
    pooling_kernel_size: int
    num_frames: int | None
    do_resize: bool

    @classmethod
    def from_bundle(cls, bundle: ProcessorBundle) -> Gemma4VideoSettings:
        """The loaded video processor's settings; without one (no torchvision) its config where transformers
        looks: ``processor_config.json``'s ``video_processor`` section, else ``video_preprocessor_config.json``,
        else ``preprocessor_config.json`` (what `ProcessorBundle.video_config` holds then)."""
        loaded = getattr(bundle.processor, "video_processor", None) if bundle.processor is not None else None
        nested = bundle.processor_config.get("video_processor")
        config = nested if loaded is None and isinstance(nested, dict) else bundle.video_config
        return cls.from_config(config, bundle.source)

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> Gemma4VideoSettings:
        """From the video processor's config (`ProcessorBundle.video_config`), class defaults for missing keys."""
        merged = {**VIDEO_CLASS_DEFAULTS, **{k: v for k, v in config.items() if k in VIDEO_CLASS_DEFAULTS}}
        budget = int(merged["max_soft_tokens"])
        if budget not in SUPPORTED_SOFT_TOKENS:
            raise ProcessorLoadError(f"{source}: video max_soft_tokens {budget} is not one of {SUPPORTED_SOFT_TOKENS}")
        return cls(
            max_soft_tokens=budget,
            patch_size=int(merged["patch_size"]),
            pooling_kernel_size=int(merged["pooling_kernel_size"]),
            num_frames=None if merged["num_frames"] is None else int(merged["num_frames"]),
            do_resize=bool(merged["do_resize"]),
        )

    def soft_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of soft tokens of every frame of a ``width`` x ``height`` video."""
        target_h, target_w = aspect_preserving_size(
            width, height, self.max_soft_tokens, self.patch_size, self.pooling_kernel_size
        )
        side = self.pooling_kernel_size * self.patch_size
        return target_h // side, target_w // side
