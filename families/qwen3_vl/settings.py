"""What both Qwen3-VL / Qwen3.5 faces read from the processor, derived once (`families.settings.GridSettings`).

As Qwen2-VL's, with ``Qwen3VLVideoProcessor``'s class defaults for keys a video config leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from families.settings import GridSettings, VideoSettings

# Qwen3VLVideoProcessor class attributes, used only for keys a config file leaves out
# when the video processor itself cannot be imported (no torchvision).
QWEN3_VIDEO_CLASS_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "fps": 2,
    "do_sample_frames": True,
    "cap_pixels_per_frame": None,
    "max_video_tokens": 768,
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3VLSettings(GridSettings):
    """The processor's settings both faces use (`Qwen3VLCounter`, `Qwen3VLLayout`)."""

    video_class_defaults: ClassVar[dict[str, Any] | None] = QWEN3_VIDEO_CLASS_DEFAULTS

    video: VideoSettings  # always set: the counter samples frames in closed form
