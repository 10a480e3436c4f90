"""What a model family's media counter provides (prep's face of a family).

A counter answers, in closed form and without pixels, what the family's HF processor
would do with one media item: its resize grid, its sampled frames, and the exact token
ids that replace the item's placeholder token in the rendered chat text. Each family's
``families/<name>/counter.py`` holds one; `families.registry` finds it by processor class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from families.processor import ProcessorBundle
from families.run_text import RunText
from schemas.dataset_config import VideoSampling
from schemas.media import MediaKind, VideoMeta

NO_VIDEO_TOKEN = -1  # the video_token_id of a family that takes no video: no token id is negative, no splice


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
    # text merges with its neighbours in BPE (Gemma 3's "\n\n", row newlines, timestamps), as
    # literal pieces and runs of one token (`expansion_text` is the whole text). When set,
    # ``expansion`` is unused.
    expansion_runs: RunText | None = None
    num_tiles: int = 1  # image arrays the processor makes of the item (tiles/crops + global view)
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] = field(default=())
    width: int = 0  # source size after EXIF orientation, filled in by the caller
    height: int = 0
    num_bytes: int = 0  # encoded size of the item, filled in by the caller

    @property
    def expansion_text(self) -> str | None:
        """The text that replaces the placeholder token's text, or None for an id-level expansion
        (built on each call: the tokenizer reads `expansion_runs`)."""
        return None if self.expansion_runs is None else self.expansion_runs.text


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


class TokenIds(Protocol):
    """Settings that hold both placeholder ids."""

    @property
    def image_token_id(self) -> int: ...

    @property
    def video_token_id(self) -> int: ...


class IdsFromSettings:
    """A counter's ``image_token_id`` / ``video_token_id``: those of the settings it shares with its layout."""

    __slots__ = ()
    settings: TokenIds

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.settings.video_token_id


CounterFactory = Callable[[ProcessorBundle], MediaCounter]


class CounterClass(Protocol):
    """A counter class: built from the loaded processor."""

    def from_processor(self, bundle: ProcessorBundle) -> MediaCounter: ...


IMAGE_ATTENTION = ("causal", "bidirectional")


def image_attention(counter: object) -> str:
    """How the family's model attends inside an image block: "causal" unless the counter says otherwise."""
    value = getattr(counter, "image_attention", "causal")
    if value not in IMAGE_ATTENTION:
        raise ValueError(f"{type(counter).__name__}.image_attention = {value!r}; expected one of {IMAGE_ATTENTION}")
    return str(value)
