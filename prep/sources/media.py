"""Media references and header-only metadata: image sizes and video frame counts.

A reference is a file path or ``"/path/to/db.lmdb::KEY"`` (value = original encoded
image bytes). Nothing here decodes pixels: image sizes come from the file header (plus
the EXIF orientation tag, which transformers' ``load_image`` applies), video metadata
from the container (PyAV). A truncated JPEG/PNG is caught by its missing end marker.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import lmdb
from PIL import Image, UnidentifiedImageError

LMDB_SEPARATOR = "::"
EXIF_ORIENTATION_TAG = 0x0112
SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
JPEG_END = b"\xff\xd9"
PNG_END = b"IEND\xaeB`\x82"


class MediaError(Exception):
    """A media item cannot be used; ``reason`` is a schemas.reasons.Reason value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaRef:
    """Where a media item's encoded bytes live."""

    path: str  # file, or LMDB directory when key is set
    key: str | None = None

    @property
    def uri(self) -> str:
        return self.path if self.key is None else f"{self.path}{LMDB_SEPARATOR}{self.key}"


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


def parse_ref(entry: str, media_dir: Path) -> MediaRef:
    """Resolve a dataset entry; relative paths are taken from the dataset's media_dir."""
    path, sep, key = entry.partition(LMDB_SEPARATOR)
    resolved = Path(path) if Path(path).is_absolute() else media_dir / path
    return MediaRef(path=str(resolved), key=key if sep else None)


class LmdbPool:
    """Read-only LMDB environments opened once per process and reused for every sample."""

    def __init__(self) -> None:
        self._envs: dict[str, lmdb.Environment] = {}

    def get(self, ref: MediaRef) -> bytes:
        env = self._envs.get(ref.path)
        if env is None:
            if not Path(ref.path).exists():
                raise MediaError("missing_media", f"LMDB {ref.path!r} does not exist")
            env = lmdb.open(ref.path, readonly=True, lock=False, readahead=False, subdir=Path(ref.path).is_dir())
            self._envs[ref.path] = env
        with env.begin(buffers=False) as txn:
            value = txn.get(ref.key.encode("utf-8"))
        if value is None:
            raise MediaError("missing_lmdb_key", f"key {ref.key!r} not in LMDB {ref.path!r}")
        return value

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()


def read_bytes(ref: MediaRef, pool: LmdbPool) -> bytes:
    """The original encoded bytes of a media item (for verification and shard writing)."""
    if ref.key is not None:
        return pool.get(ref)
    try:
        return Path(ref.path).read_bytes()
    except FileNotFoundError as exc:
        raise MediaError("missing_media", f"file {ref.path!r} does not exist") from exc


def image_size(ref: MediaRef, pool: LmdbPool) -> tuple[int, int]:
    """(width, height) as the processor will see the image, from the header only."""
    if ref.key is not None:
        return _header_size(io.BytesIO(pool.get(ref)), ref.uri)
    if not Path(ref.path).is_file():
        raise MediaError("missing_media", f"file {ref.path!r} does not exist")
    with open(ref.path, "rb") as fh:
        return _header_size(fh, ref.uri)


def _header_size(fh: io.BufferedIOBase, uri: str) -> tuple[int, int]:
    try:
        with Image.open(fh) as img:
            width, height = img.size
            fmt = img.format
            orientation = img.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except UnidentifiedImageError as exc:  # its message embeds a memory address: keep output deterministic
        raise MediaError("corrupt_image", f"{uri}: not a recognised image format") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError("corrupt_image", f"{uri}: not a readable image ({exc})") from exc
    _check_trailer(fh, fmt, uri)
    if width < 1 or height < 1:
        raise MediaError("corrupt_image", f"{uri}: empty image {width}x{height}")
    if orientation in SWAPPING_ORIENTATIONS:
        width, height = height, width
    return width, height


def _check_trailer(fh: io.BufferedIOBase, fmt: str | None, uri: str) -> None:
    """Truncated files pass a header read but fail to decode later: check the end marker."""
    marker = {"JPEG": JPEG_END, "PNG": PNG_END}.get(fmt or "")
    if marker is None:
        return
    fh.seek(0, io.SEEK_END)
    size = fh.tell()
    fh.seek(max(0, size - 64))
    if marker not in fh.read():
        raise MediaError("corrupt_image", f"{uri}: truncated {fmt} (no end marker)")


def video_meta(ref: MediaRef) -> VideoMeta:
    """Frame count, fps and frame size from the container, without decoding frames."""
    import av  # deferred: PyAV is only needed for datasets with video

    if ref.key is not None:
        raise MediaError("bad_video", f"{ref.uri}: videos are read from files, not LMDB")
    if not Path(ref.path).is_file():
        raise MediaError("missing_media", f"file {ref.path!r} does not exist")
    try:
        with av.open(ref.path) as container:
            if not container.streams.video:
                raise MediaError("bad_video", f"{ref.uri}: no video stream")
            stream = container.streams.video[0]
            # the same fields transformers' PyAV reader puts in VideoMetadata
            num_frames = int(stream.frames)
            fps = float(stream.average_rate) if stream.average_rate else 0.0
            width, height = stream.width, stream.height
            if num_frames <= 0:  # mkv/webm headers often omit it: count packets, no decoding
                num_frames = sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.FFmpegError as exc:
        raise MediaError("bad_video", f"{ref.uri}: unreadable video ({exc})") from exc
    if num_frames <= 0 or fps <= 0 or width <= 0 or height <= 0:
        raise MediaError("bad_video", f"{ref.uri}: missing frame count/fps/size in container")
    return VideoMeta(num_frames=num_frames, fps=fps, width=width, height=height)
