"""What both Qwen2-VL / Qwen2.5-VL faces read from the processor, derived once (`families.settings.GridSettings`).

The image rule comes from the loaded image processor; video settings from the loaded video
processor or its config file, with the class defaults below for keys the file leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from families.settings import GridSettings, VideoSettings

# Qwen2VLVideoProcessor class attributes, used only for keys a config file leaves out
# when the video processor itself cannot be imported (no torchvision).
QWEN2_VIDEO_CLASS_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "fps": None,
    "do_sample_frames": False,
    "cap_pixels_per_frame": None,
    "max_video_tokens": 128000,
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen2VLSettings(GridSettings):
    """The processor's settings both faces use (`Qwen2VLCounter`, `Qwen2VLLayout`)."""

    video_class_defaults: ClassVar[dict[str, Any] | None] = QWEN2_VIDEO_CLASS_DEFAULTS

    video: VideoSettings  # always set: the counter samples frames in closed form
