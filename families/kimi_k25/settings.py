"""What both Kimi K2.5 faces read from the processor, derived once: the image token and the NaViT resize.

``Kimi_K25ImageProcessor`` exists only as a torchvision class. Without torchvision
`families.processor.load_processor` keeps its ``preprocessor_config.json`` as a settings-only
object, so the counter runs anywhere; the class defaults below fill keys the file leaves out
(transformers 5.24 ``image_processing_kimi_k25.Kimi_K25ImageProcessor``).
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
IMAGE_TOKEN = "<|media_pad|>"  # Kimi_K25Processor.image_token unless the tokenizer names one


def _max_side_patches(size: Any) -> int:
    """``size.max_height`` (patches per side: the processor multiplies it by the patch size)."""
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    height, width = get("max_height"), get("max_width")
    if height is None or height != width:
        raise ValueError(f"Kimi K2.5 image processor size {size!r} needs equal max_height and max_width")
    return int(height)


@dataclass(frozen=True, kw_only=True, slots=True)
class KimiK25Settings:
    """The processor's settings both faces use (`KimiK25Counter`, `KimiK25Layout`)."""

    image_token_id: int  # <|media_pad|>: each stands for merge x merge patches
    patch_size: int  # 14 px
    merge_size: int  # 2: the 2x2 patch merger
    max_patches: int  # total patch budget before padding (16384)
    max_side_patches: int  # patches a side may span (size.max_height, 512)

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
        )

    @property
    def factor(self) -> int:
        """Pixels a side of one ``<|media_pad|>`` token (patch x merge): padded sides are multiples of it."""
        return self.patch_size * self.merge_size
