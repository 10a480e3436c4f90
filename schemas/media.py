"""What a media item is to a family's counter: its kind, and a video's container metadata.

`prep.sources` reads them (headers only); `families` counters turn them into token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MediaKind = Literal["image", "video"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoMeta:
    """Container metadata the processor's frame sampling depends on."""

    num_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps
