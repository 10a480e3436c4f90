"""What a model family's media counter provides, and the registry that finds it.

A counter answers, in closed form and without pixels, what the family's HF processor
would do with one media item: its resize grid, its sampled frames, and the exact token
ids that replace the item's placeholder token in the rendered chat text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prep.sources.media import VideoMeta
from schemas.dataset_config import VideoSampling


class MediaRejected(ValueError):
    """The processor would refuse this item (e.g. aspect ratio > 200); becomes an error row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaCount:
    """One media item as the processor sees it."""

    kind: str  # "image" | "video"
    grid_t: int
    grid_h: int
    grid_w: int
    num_tokens: int  # placeholder (vision-embedding) tokens
    expansion: tuple[int, ...]  # token ids that replace the template's placeholder token
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] = field(default=())
    width: int = 0  # source size after EXIF orientation, filled in by the caller
    height: int = 0


class MediaCounter(Protocol):
    """Per-family closed-form counter, built once per worker from the loaded processor."""

    image_token_id: int
    video_token_id: int

    def count_image(self, width: int, height: int) -> MediaCount: ...

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount: ...

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """Keyword arguments that make the real processor sample frames as we counted."""
        ...


CounterFactory = Callable[[Any], MediaCounter]
_REGISTRY: dict[str, CounterFactory] = {}


def register_counter(*processor_classes: str) -> Callable[[type], type]:
    """Class decorator: the counter serves processors of these class names."""

    def wrap(cls: type) -> type:
        for name in processor_classes:
            _REGISTRY[name] = cls.from_processor
        return cls

    return wrap


def find_counter(processor_class: str) -> CounterFactory | None:
    """The registered counter factory for a processor class, or None (use the processor)."""
    from prep.tokenize.families import qwen2_vl, qwen3_vl  # noqa: F401  (registers)

    return _REGISTRY.get(processor_class)
