"""What a model family's media counter provides, and the registry that finds it.

A counter answers, in closed form and without pixels, what the family's HF processor
would do with one media item: its resize grid, its sampled frames, and the exact token
ids that replace the item's placeholder token in the rendered chat text. Counters of every
module of this package are registered when the package is imported (its ``__init__``),
which importing this module does first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prep.sources.conversation import MediaKind
from prep.sources.media import VideoMeta
from prep.tokenize.processor import ProcessorBundle
from schemas.dataset_config import VideoSampling


class MediaRejected(ValueError):
    """The processor would refuse this item (e.g. aspect ratio > 200); becomes an error row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaCount:
    """One media item as the processor sees it."""

    kind: MediaKind
    grid_t: int
    grid_h: int
    grid_w: int
    num_tokens: int  # placeholder (vision-embedding) tokens
    expansion: tuple[int, ...]  # token ids that replace the template's placeholder token
    # Text that replaces the placeholder token's text *before* tokenizing, for expansions whose
    # text merges with its neighbours in BPE (Gemma 3's "\n\n", row newlines, timestamps).
    # When set, ``expansion`` is unused.
    expansion_text: str | None = None
    num_tiles: int = 1  # image arrays the processor makes of the item (tiles/crops + global view)
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] = field(default=())
    width: int = 0  # source size after EXIF orientation, filled in by the caller
    height: int = 0
    num_bytes: int = 0  # encoded size of the item, filled in by the caller


class MediaCounter(Protocol):
    """Per-family closed-form counter, built once per worker from the loaded processor.

    A counter class may set ``counts_video = False`` (video takes the real processor) and
    ``image_attention = "bidirectional"`` (the model attends both ways inside an image block,
    which a causal packed kernel cannot express; recorded in the manifest for ``train``).
    """

    @property
    def image_token_id(self) -> int: ...

    @property
    def video_token_id(self) -> int: ...

    def count_image(self, width: int, height: int) -> MediaCount: ...

    def count_video(self, meta: VideoMeta, sampling: VideoSampling) -> MediaCount: ...

    def processor_video_kwargs(self, sampling: VideoSampling) -> dict[str, Any]:
        """Keyword arguments that make the real processor sample frames as we counted."""
        ...


CounterFactory = Callable[[ProcessorBundle], MediaCounter]


class CounterClass(Protocol):
    """A counter class: built from the loaded processor."""

    def from_processor(self, bundle: ProcessorBundle) -> MediaCounter: ...


C = TypeVar("C", bound=CounterClass)
_REGISTRY: dict[str, CounterClass] = {}  # processor class name -> counter class


def register_counter(*processor_classes: str) -> Callable[[C], C]:
    """Class decorator: the counter serves processors of these class names."""

    def wrap(cls: C) -> C:
        for name in processor_classes:
            _REGISTRY[name] = cls
        return cls

    return wrap


IMAGE_ATTENTION = ("causal", "bidirectional")


def image_attention(counter: object) -> str:
    """How the family's model attends inside an image block: "causal" unless the counter says otherwise."""
    value = getattr(counter, "image_attention", "causal")
    if value not in IMAGE_ATTENTION:
        raise ValueError(f"{type(counter).__name__}.image_attention = {value!r}; expected one of {IMAGE_ATTENTION}")
    return str(value)


def counter_image_attention(processor_class: str) -> str:
    """``image_attention`` of the counter serving ``processor_class`` ("causal" without one)."""
    cls = _REGISTRY.get(processor_class)
    return "causal" if cls is None else image_attention(cls)


def find_counter(processor_class: str) -> CounterFactory | None:
    """The registered counter factory for a processor class, or None (use the processor)."""
    cls = _REGISTRY.get(processor_class)
    return None if cls is None else cls.from_processor
