"""What both Gemma 3 faces read from the processor, derived once: image kwargs, soft tokens, pan-and-scan.

``Gemma3Processor.images_kwargs`` turns pan-and-scan off unless a call turns it on, over
``preprocessor_config.json`` (`families.settings.merged_images_kwargs`): the counter counts
crops with the effective settings, the layout calls the image processor with the same kwargs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings, merged_images_kwargs

DEFAULT_IMAGE_SEQ_LENGTH = 256  # Gemma3Processor.__init__ default
PAN_AND_SCAN_KEYS = (
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PanAndScan:
    """The effective pan-and-scan settings (only when ``do_pan_and_scan`` is on)."""

    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float

    def crop_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of crops, (0, 0) for none: ``Gemma3ImageProcessorPil.pan_and_scan``."""
        if width >= height:
            if width / height < self.min_ratio_to_activate:
                return 0, 0
            cols = self._num_crops(width, height)
            rows = 1
        else:
            if height / width < self.min_ratio_to_activate:
                return 0, 0
            rows = self._num_crops(height, width)
            cols = 1
        crop_width = int(math.ceil(width / cols))
        crop_height = int(math.ceil(height / rows))
        if min(crop_width, crop_height) < self.min_crop_size:
            return 0, 0
        return rows, cols

    def _num_crops(self, long_side: int, short_side: int) -> int:
        """Crops along the long side: the aspect rounded half up, bounded by the crop size, in [2, max]."""
        n = int(math.floor(long_side / short_side + 0.5))
        n = min(int(math.floor(long_side / self.min_crop_size)), n)
        return min(self.max_num_crops, max(2, n))


def _pan_and_scan(bundle: ProcessorBundle, merged: dict[str, Any]) -> PanAndScan | None:
    kwargs = effective_image_settings(bundle, ("do_pan_and_scan", *PAN_AND_SCAN_KEYS), merged)
    if not kwargs["do_pan_and_scan"]:
        return None
    missing = [k for k in PAN_AND_SCAN_KEYS if kwargs[k] is None]
    if missing:
        raise ProcessorLoadError(f"{bundle.source}: do_pan_and_scan is on but {', '.join(missing)} unset")
    return PanAndScan(
        min_crop_size=int(kwargs["pan_and_scan_min_crop_size"]),
        max_num_crops=int(kwargs["pan_and_scan_max_num_crops"]),
        min_ratio_to_activate=float(kwargs["pan_and_scan_min_ratio_to_activate"]),
    )


def _image_seq_length(bundle: ProcessorBundle) -> int:
    """The processor's ``image_seq_length`` (processor_config.json), as ``Gemma3Processor`` reads it."""
    value = getattr(bundle.processor, "image_seq_length", None) if bundle.processor is not None else None
    if value is None:
        value = bundle.processor_config.get("image_seq_length")
    return DEFAULT_IMAGE_SEQ_LENGTH if value is None else int(value)


def tokenizer_token(bundle: ProcessorBundle, attribute: str) -> str:
    """``tokenizer.boi_token`` / ``eoi_token`` / ``image_token``: what ``Gemma3Processor.__init__`` reads."""
    token = getattr(bundle.tokenizer, attribute, None)
    if not isinstance(token, str) or not token:
        raise ProcessorLoadError(f"{bundle.source}: the Gemma 3 tokenizer has no {attribute} (tokenizer_config.json)")
    return token


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3Settings:
    """The processor's settings both faces use (`Gemma3Counter`, `Gemma3Layout`)."""

    images_kwargs: dict[str, Any]  # what the processor passes its image processor
    image_seq_length: int  # <image_soft_token> per image and per crop
    pan_and_scan: PanAndScan | None  # None: off
    soft_token: str  # <image_soft_token> (tokenizer.image_token): one per image feature
    soft_token_id: int  # the model's config.image_token_id

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Gemma3Settings:
        merged = merged_images_kwargs(bundle)
        soft = tokenizer_token(bundle, "image_token")
        return cls(
            images_kwargs=merged,
            image_seq_length=_image_seq_length(bundle),
            pan_and_scan=_pan_and_scan(bundle, merged),
            soft_token=soft,
            soft_token_id=bundle.token_id(soft, "image_token"),
        )
