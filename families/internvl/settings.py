"""What both InternVL faces read from the processor, derived once: tiling and tokens per tile.

``crop_to_patches`` comes from ``InternVLProcessor.images_kwargs`` (True), which a processor
call passes over the ``false`` of the checkpoints' ``preprocessor_config.json``
(`families.settings.effective_image_settings`); ``image_seq_length`` is the processor's own
(``processor_config.json``), so the processor must be buildable here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle, ProcessorLoadError
from families.settings import effective_image_settings


@dataclass(frozen=True, kw_only=True, slots=True)
class InternVLSettings:
    """The processor's settings both faces use (`InternVLCounter`, `InternVLLayout`)."""

    image_token_id: int  # <IMG_CONTEXT>: the template's per-image placeholder, one per tile token
    image_seq_length: int  # <IMG_CONTEXT> per tile (processor_config.json, default 256)
    tile_width: int
    tile_height: int
    crop_to_patches: bool  # the effective value: the processor's images_kwargs over the file's
    min_patches: int
    max_patches: int

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> InternVLSettings:
        processor: Any = bundle.processor  # InternVLProcessor: image_seq_length from processor_config.json
        if processor is None:
            raise ProcessorLoadError(
                f"{bundle.source}: InternVLProcessor could not be built; cannot read image_seq_length"
            )
        kwargs = effective_image_settings(bundle, ("size", "crop_to_patches", "min_patches", "max_patches"))
        tile_width, tile_height = _size(kwargs["size"])
        return cls(
            image_token_id=bundle.token_id("<IMG_CONTEXT>", "context_image_token"),
            image_seq_length=int(processor.image_seq_length),
            tile_width=tile_width,
            tile_height=tile_height,
            crop_to_patches=bool(kwargs["crop_to_patches"]),
            min_patches=int(kwargs["min_patches"]),
            max_patches=int(kwargs["max_patches"]),
        )


def _size(size: Any) -> tuple[int, int]:
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    height, width = get("height"), get("width")
    if height is None or width is None:
        raise ProcessorLoadError(f"InternVL image processor size {size!r} lacks height/width")
    return int(width), int(height)
