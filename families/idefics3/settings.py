"""What both Idefics3 / SmolVLM faces read from the processor, derived once.

The image kwargs a processor call passes (`families.settings.merged_images_kwargs`: size,
``max_image_size``, ``do_image_splitting`` as the processor class overrides the file), the
prompt tokens and ``image_seq_len`` (``processor_config.json``, else ``Idefics3Processor``'s
default 169): the counter writes the expansion with them, the layout calls the image
processor with them and checks its tiles against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from families.processor import ProcessorBundle
from families.settings import effective_image_settings, merged_images_kwargs

DEFAULT_IMAGE_SEQ_LEN = 169  # Idefics3Processor.__init__ default


@dataclass(frozen=True, kw_only=True, slots=True)
class Idefics3Settings:
    """The processor's settings both faces use (`Idefics3Counter`, `Idefics3Layout`)."""

    images_kwargs: dict[str, Any]  # what the processor passes its image processor
    image_token: str  # <image>: the template's placeholder and the per-tile embedding token
    image_token_id: int
    fake_image_token: str
    global_image_token: str
    image_seq_len: int  # <image> tokens per tile
    size: Any  # the effective ``size`` (its longest_edge is what images are rescaled to)
    do_resize: bool
    longest_edge: int  # 0 where ``size`` has none
    do_image_splitting: bool
    tile: int  # max_image_size.longest_edge: the side of every tile

    @classmethod
    def from_processor(cls, bundle: ProcessorBundle) -> Idefics3Settings:
        processor: Any = bundle.processor
        tokenizer = bundle.tokenizer
        merged = merged_images_kwargs(bundle)
        kwargs = effective_image_settings(bundle, ("size", "max_image_size", "do_resize", "do_image_splitting"), merged)
        size = kwargs["size"]
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        image = _token(processor, tokenizer, "image_token", "<image>")
        global_tag = getattr(processor, "global_image_tag", None) or _token(
            processor, tokenizer, "global_image_token", "<global-img>"
        )
        seq_len = getattr(processor, "image_seq_len", None) or bundle.processor_config.get(
            "image_seq_len", DEFAULT_IMAGE_SEQ_LEN
        )
        return cls(
            images_kwargs=merged,
            image_token=image,
            image_token_id=bundle.token_id(image, "image_token"),
            fake_image_token=_token(processor, tokenizer, "fake_image_token", "<fake_token_around_image>"),
            global_image_token=global_tag,
            image_seq_len=int(seq_len),
            size=size,
            do_resize=bool(kwargs["do_resize"]),
            longest_edge=int(longest or 0),
            do_image_splitting=bool(kwargs["do_image_splitting"]),
            tile=int(kwargs["max_image_size"]["longest_edge"]),
        )


def _token(processor: Any, tokenizer: Any, attribute: str, default: str) -> str:
    """A prompt token string as the processor holds it (SmolVLM reads the tokenizer's attributes)."""
    value = getattr(processor, attribute, None) or getattr(tokenizer, attribute, None) or default
    return str(value)
