"""Synthetic video clips for the video tests, and the real processor that reads them from their paths.

A test names its clips once (name -> `Clip`, or a ``(frames, fps, width, height)`` tuple) and
`write_clips` encodes them with `prep.example.media.write_video` (PyAV, deterministic bytes;
sides even for yuv420p), each seeded by its place in the table unless it names a seed, so the
same table gives the same files in every test that uses it. `real_processor` is the truth's
processor: transformers' ``AutoProcessor`` whose video processor decodes paths with prep's own
PyAV reader (`prep.tokenize.processor_path.fetch_videos_with_pyav`, what ``--verify-fraction``
runs; transformers' default reader is torchcodec) and samples the frames itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prep.example.media import write_video
from prep.tokenize.processor_path import fetch_videos_with_pyav


@dataclass(frozen=True)
class Clip:
    """One synthetic clip: ``frames`` frames of ``width`` x ``height`` at ``fps``."""

    frames: int
    fps: float
    width: int
    height: int
    seed: int | None = None  # None: the clip's place in its table
    codec: str | None = None  # None: the container's default (`prep.example.media.VIDEO_FORMATS`)
    suffix: str = ".mp4"


def write_clips(root: Path, clips: Mapping[str, Clip | tuple[int, float, int, int]]) -> dict[str, Path]:
    """Each clip as ``root/<name><suffix>``; name -> path, in the table's order."""
    paths = {}
    for index, (name, spec) in enumerate(clips.items()):
        clip = spec if isinstance(spec, Clip) else Clip(*spec)
        seed = index if clip.seed is None else clip.seed
        path = root / f"{name}{clip.suffix}"
        paths[name] = write_video(path, clip.frames, clip.fps, clip.width, clip.height, codec=clip.codec, seed=seed)
    return paths


def read_with_pyav(processor: Any) -> Any:
    """``processor`` with its video processor decoding paths with prep's PyAV reader (this instance only)."""
    processor.video_processor.fetch_videos = fetch_videos_with_pyav
    return processor


def real_processor(processor_dir: Path | str) -> Any:
    """``AutoProcessor`` of ``processor_dir`` reading videos from their paths with PyAV (needs torchvision)."""
    from transformers import AutoProcessor

    return read_with_pyav(AutoProcessor.from_pretrained(str(processor_dir)))
