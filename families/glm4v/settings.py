"""What both GLM-4.xV faces read from the processor, derived once (`families.settings.GridSettings`).

The image fields are the effective call-time settings (`families.settings.effective_image_settings`);
``Glm4vImageProcessorPil.resize`` also reads the image processor's ``temporal_patch_size`` (its
``smart_resize`` budget counts that many frames per image). Video is not counted (``video`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import GridSettings, effective_image_settings


@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vSettings(GridSettings):
    """The processor's settings both faces use (`Glm4vCounter`, `Glm4vLayout`)."""

    tokens: ClassVar[tuple[str, str]] = ("<|image|>", "<|video|>")

    image_temporal_patch_size: int  # the image processor's: frames its smart_resize budgets per image

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Self:
        kwargs = effective_image_settings(bundle, ("size", "patch_size", "temporal_patch_size", "merge_size"))
        min_pixels, max_pixels = _pixel_limits(kwargs["size"])
        return cls(
            **cls.tokens_and_video(bundle),
            patch_size=int(kwargs["patch_size"]),
            merge_size=int(kwargs["merge_size"]),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_temporal_patch_size=int(kwargs["temporal_patch_size"]),
        )


def _pixel_limits(size: Any) -> tuple[int, int]:
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    shortest, longest = get("shortest_edge"), get("longest_edge")
    if not shortest or not longest:  # Glm4vImageProcessorPil.resize raises the same
        raise ProcessorLoadError(f"GLM image processor size {size!r} lacks shortest_edge/longest_edge")
    return int(shortest), int(longest)
