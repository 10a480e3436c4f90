"""What both PaddleOCR-VL faces read from the processor, derived once: placeholder id, patch grid, pixel limits.

``PaddleOCRVLProcessor`` adds no image kwargs of its own, so a call resizes with the loaded
image processor's ``size`` (``shortest_edge`` / ``longest_edge`` = min / max pixels; the
``min_pixels`` / ``max_pixels`` keys of ``preprocessor_config.json`` land there) and its
``patch_size`` / ``merge_size``. The closed form is ``PaddleOCRVLImageProcessor``'s resize:
another image processor under this processor class is refused, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings

IMAGE_PROCESSORS = ("PaddleOCRVLImageProcessor",)  # the PIL and torchvision backends share the resize
IMAGE_TOKEN = "<|IMAGE_PLACEHOLDER|>"  # PaddleOCR-VL's tokenizer.image_token


def _pixel_limits(size: Any) -> tuple[int, int]:
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    shortest, longest = get("shortest_edge"), get("longest_edge")
    if not shortest or not longest:  # PaddleOCRVLImageProcessorPil.resize raises the same
        raise ProcessorLoadError(f"PaddleOCR-VL image processor size {size!r} lacks shortest_edge/longest_edge")
    return int(shortest), int(longest)


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddleOCRVLSettings:
    """The processor's settings both faces use (`PaddleOCRVLCounter`, `PaddleOCRVLLayout`)."""

    image_token_id: int  # <|IMAGE_PLACEHOLDER|>: the template's per-image placeholder and its expansion
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> PaddleOCRVLSettings:
        ip = bundle.image_processor
        if not type(ip).__name__.startswith(IMAGE_PROCESSORS):
            raise ProcessorLoadError(
                f"{bundle.source}: {bundle.processor_class} with {type(ip).__name__}; the closed form knows only "
                f"{' / '.join(IMAGE_PROCESSORS)} resizing"
            )
        kwargs = effective_image_settings(bundle, ("size", "patch_size", "merge_size", "temporal_patch_size"))
        min_pixels, max_pixels = _pixel_limits(kwargs["size"])
        return cls(
            image_token_id=bundle.token_id(IMAGE_TOKEN, "image_token"),
            patch_size=int(kwargs["patch_size"]),
            merge_size=int(kwargs["merge_size"]),
            temporal_patch_size=int(kwargs["temporal_patch_size"] or 1),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
