"""A pack's stored media -> the model's vision inputs, with the model's own processors.

Images are decoded from their original bytes by transformers' ``load_image`` (EXIF transpose,
then ``convert("RGB")``: alpha is dropped, palette/grey expanded) - the rules `prep tokenize`
assumed when it counted tokens from headers - and run through the loaded image processor one
image at a time (one call per pack gives identical tensors and is no faster, and per-image
calls name the failing item). Videos: exactly the frames listed in ``frame_indices`` are
decoded with PyAV (``rgb24``, as transformers' PyAV reader ``load_video(backend="pyav")`` does)
and given to the processor's video processor with ``do_sample_frames=False``. Note that a
processor given a video *path* decodes with torchcodec by default (it needs system FFmpeg);
torchcodec's RGB conversion is not checked to be bit-identical to PyAV's.
`tests/train/test_video.py` checks this path against the real processors (needs torchvision).

Every grid the processor returns must equal the ``grid_thw`` stored at tokenize time: that is
what keeps the token plan exact end to end; otherwise `GridMismatchError`. Every error here
is a broken invariant, never a pack to skip: `train.loader` re-raises it as is, and
`train.encoder.PackedBatchTaskEncoder` lowers Energon's failure tolerance to 1 so that any
other loader stops on it too.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import load_image

from packvlm.errors import DataBudgetError
from schemas.packed import PackedMediaItem


class PackEncodeError(DataBudgetError, ValueError):
    """A pack cannot become a micro-batch; the message names pack, sample and fix."""


class GridMismatchError(PackEncodeError):
    """The processor's grid differs from the grid `prep tokenize` counted: the plan is broken."""


class VideoProcessorUnavailable(PackEncodeError):
    """A pack holds a video but no video processor could be loaded (needs torchvision)."""


class MediaDecodeError(PackEncodeError):
    """Stored media bytes no longer decode (tokenize decoded their headers without error)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaOrigin:
    """Where a media item sits, for error messages."""

    pack_key: str
    sample_id: str
    member: str

    @classmethod
    def of(cls, pack_key: str, item: PackedMediaItem, sample_ids: Sequence[str]) -> MediaOrigin:
        return cls(pack_key=pack_key, sample_id=sample_ids[item.meta.sample], member=item.meta.member)

    def __str__(self) -> str:
        return f"pack {self.pack_key}, sample {self.sample_id}, member {self.member}"


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionInputs:
    """The vision tensors of one pack, concatenated in token order (None when absent)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedVideo:
    """Frames in ``frame_indices`` order plus the container fields tokenize read (same source)."""

    frames: np.ndarray  # uint8 [n, H, W, 3]
    total_frames: int
    fps: float

    @property
    def sampled_fps(self) -> float:
        """transformers' ``VideoMetadata.sampled_fps``: frames kept per second of video."""
        return len(self.frames) / self.total_frames * self.fps


def decode_image(data: bytes, origin: MediaOrigin) -> Image.Image:
    """Decode like ``transformers.image_utils.load_image``: EXIF transpose, then RGB."""
    try:
        image = Image.open(io.BytesIO(data))
        return load_image(image)
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaDecodeError(f"{origin}: image does not decode ({exc}); re-run prep pack") from exc


def decode_video_frames(data: bytes, frame_indices: Sequence[int], origin: MediaOrigin) -> DecodedVideo:
    """Decode exactly ``frame_indices`` (sorted, unique), stopping after the last one."""
    import av  # deferred: only datasets with video need PyAV

    wanted = list(frame_indices)
    if not wanted or wanted != sorted(set(wanted)):
        raise MediaDecodeError(f"{origin}: frame_indices {wanted[:8]} must be non-empty, sorted and unique")
    keep = set(wanted)
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            # the same fields prep.sources.media.video_meta (and transformers' PyAV reader) read
            total = int(stream.frames)
            fps = float(stream.average_rate) if stream.average_rate else 0.0
            if total <= 0:  # header without a frame count: count packets, as tokenize did
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            for index, frame in enumerate(container.decode(video=0)):
                if index in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= wanted[-1]:
                    break
    except (av.error.FFmpegError, IndexError) as exc:
        raise MediaDecodeError(f"{origin}: video does not decode ({exc}); re-run prep pack") from exc
    if len(frames) != len(wanted) or fps <= 0:
        raise MediaDecodeError(f"{origin}: decoded {len(frames)} of {len(wanted)} frames (fps {fps})")
    return DecodedVideo(frames=np.stack(frames), total_frames=total, fps=fps)


def check_grid(origin: MediaOrigin, stored: Sequence[int], actual: Sequence[int]) -> None:
    """Raise `GridMismatchError` unless the processor's grid equals the stored one."""
    if tuple(int(x) for x in actual) != tuple(int(x) for x in stored):
        raise GridMismatchError(
            f"{origin}: processor grid {tuple(int(x) for x in actual)} != stored grid "
            f"{tuple(int(x) for x in stored)}; the processor settings differ from those `prep tokenize` "
            "used: train with the same processor or re-run tokenize and pack"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaProcessor:
    """The model's processors for one worker; `process` is pure given them."""

    image_processor: Any
    video_processor: Any | None  # None where torchvision is missing
    #: the processor returns ``second_per_grid_ts`` (Qwen2.5-VL) for its rope index
    wants_second_per_grid_ts: bool
    temporal_patch_size: int

    @classmethod
    def from_bundle(cls, bundle: Any) -> MediaProcessor:
        """From a `prep.tokenize.processor.ProcessorBundle`."""
        processor = bundle.processor
        video = getattr(processor, "video_processor", None) if processor is not None else None
        names = list(getattr(processor, "model_input_names", []) or [])
        tps = getattr(video, "temporal_patch_size", None) or bundle.video_config.get("temporal_patch_size", 2)
        return cls(
            image_processor=bundle.image_processor,
            video_processor=video,
            wants_second_per_grid_ts="second_per_grid_ts" in names,
            temporal_patch_size=int(tps),
        )

    def process(self, pack_key: str, media: Sequence[PackedMediaItem], sample_ids: Sequence[str]) -> VisionInputs:
        """Vision tensors for a pack's media (already in token order); grids checked."""
        images = [m for m in media if m.meta.kind == "image"]
        videos = [m for m in media if m.meta.kind == "video"]
        out: dict[str, torch.Tensor] = {}
        if images:
            pixels, grids = [], []
            for item in images:
                origin = MediaOrigin.of(pack_key, item, sample_ids)
                got = self.image_processor(images=[decode_image(item.data, origin)], return_tensors="pt")
                check_grid(origin, item.meta.grid_thw, got["image_grid_thw"][0].tolist())
                pixels.append(got["pixel_values"])
                grids.append(got["image_grid_thw"])
            out["pixel_values"] = torch.cat(pixels)
            out["image_grid_thw"] = torch.cat(grids).to(torch.int64)
        if videos:
            out.update(self._videos(pack_key, videos, sample_ids))
        return VisionInputs(**out)

    def _videos(
        self, pack_key: str, videos: Sequence[PackedMediaItem], sample_ids: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        pixels, grids, seconds = [], [], []
        for item in videos:
            origin = MediaOrigin.of(pack_key, item, sample_ids)
            if self.video_processor is None:
                raise VideoProcessorUnavailable(
                    f"{origin}: the pack holds a video but the model's video processor could not be loaded "
                    "(HF video processors need torchvision): `pip install torchvision` matching your torch, "
                    "or train on image/text-only data"
                )
            decoded = decode_video_frames(item.data, item.meta.frame_indices, origin)
            got = self.video_processor(videos=[decoded.frames], do_sample_frames=False, return_tensors="pt")
            check_grid(origin, item.meta.grid_thw, got["video_grid_thw"][0].tolist())
            pixels.append(got["pixel_values_videos"])
            grids.append(got["video_grid_thw"])
            seconds.append(self.temporal_patch_size / decoded.sampled_fps)
        out = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.cat(grids).to(torch.int64)}
        if self.wants_second_per_grid_ts:
            out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return out
