"""What both Pixtral / Mistral 3 faces read from the processor, derived once: cell size and image token.

``PixtralProcessor`` reads ``patch_size``, ``spatial_merge_size`` and its image tokens from
``processor_config.json``, with class defaults for the keys the file leaves out; one ``[IMG]``
token stands for a cell of ``patch_size * spatial_merge_size`` pixels a side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle

# PixtralProcessor.__init__ defaults, used only for keys processor_config.json leaves out.
PIXTRAL_CLASS_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "spatial_merge_size": 1,
    "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
}


def _setting(bundle: ProcessorBundle, key: str) -> Any:
    """The loaded processor's attribute, else processor_config.json, else the class default."""
    value = getattr(bundle.processor, key, None) if bundle.processor is not None else None
    if value is None:
        value = bundle.processor_config.get(key)
    return PIXTRAL_CLASS_DEFAULTS[key] if value is None else value


@dataclass(frozen=True, kw_only=True, slots=True)
class PixtralSettings:
    """The processor's settings both faces use (`PixtralCounter`, `PixtralLayout`)."""

    image_token_id: int  # [IMG]
    patch_size: int  # vision patch (14 or 16 px)
    merge_size: int  # spatial_merge_size: 1 for Pixtral-12B, 2 for Mistral 3 / Ministral 3

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> PixtralSettings:
        return cls(
            image_token_id=cls.token_id(bundle, "image_token"),
            patch_size=int(_setting(bundle, "patch_size")),
            merge_size=int(_setting(bundle, "spatial_merge_size")),
        )

    @staticmethod
    def token_id(bundle: ProcessorBundle, key: str) -> int:
        """Id of the processor's ``key`` token (``image_token``, ``image_break_token``, ``image_end_token``)."""
        return bundle.token_id(str(_setting(bundle, key)), key)

    @property
    def cell(self) -> int:
        """Pixels per side of one ``[IMG]`` token: what the processor passes as the patch size."""
        return self.patch_size * self.merge_size
