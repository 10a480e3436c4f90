"""Header-only metadata of media items: image sizes, video frame counts, encoded byte sizes.

A reference (:class:`schemas.media_ref.MediaRef`) names a file, a key of an LMDB
environment whose value is the original encoded image, or a cell of a Parquet / Arrow file
holding the encoded bytes (:mod:`prep.sources.tables`). Nothing here decodes pixels: image
sizes come from the file header (plus the EXIF orientation tag, which transformers'
``load_image`` applies), video metadata from the container (an MP4/MOV ``moov`` box, else
PyAV). A truncated JPEG/PNG is caught by its missing end marker. The encoded size
(``num_bytes``) is taken while the header is read, so later stages can size shards without
opening media again.

An image whose header claims more than ``max_pixels`` (a decompression bomb: a few KB that
decode to gigabytes) is ``image_too_large``, an error row like any other, refused before
anything decodes (`packvlm.image_header`: PIL's own check set to the limit, EXIF orientation
read without the pixels). The default limit is where PIL's decoder refuses
(`DECODE_LIMIT_PIXELS`), the one `train` and the real processor decode with, so nothing
tokenize accepts fails to decode later.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from PIL import UnidentifiedImageError

from packvlm.image_header import (
    DECODE_LIMIT_PIXELS,
    ImageHeaderInfo,
    ImageTooLarge,
    read_image_fd,
    read_image_header,
)
from packvlm.mp4_header import FileBlocks, Mp4Video, read_mp4_video
from schemas.dataset_config import ConfigError
from schemas.media import VideoMeta
from schemas.media_ref import MediaRef
from schemas.reasons import Reason

if TYPE_CHECKING:
    import lmdb
JPEG_END = b"\xff\xd9"
PNG_END = b"IEND\xaeB`\x82"
_END_MARKERS = {"JPEG": JPEG_END, "PNG": PNG_END}


class MediaError(Exception):
    """A media item cannot be used; ``reason`` becomes the error row's code."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageHeader:
    """An image as the processor will see it, plus its encoded size."""

    width: int  # after EXIF orientation
    height: int
    num_bytes: int  # the file, or the LMDB value


@dataclass(frozen=True, kw_only=True, slots=True)
class VideoHeader:
    """A video's container metadata plus the size of its file."""

    meta: VideoMeta
    num_bytes: int


class LmdbPool:
    """Read-only LMDB environments opened once per process and reused for every sample."""

    def __init__(self) -> None:
        self._envs: dict[str, lmdb.Environment] = {}

    def get(self, ref: MediaRef) -> bytes:
        """The value stored under ``ref.key`` in the environment at ``ref.path``."""
        if ref.key is None:
            raise ValueError(f"{ref.format()!r} is a file reference, not an LMDB key")
        env = self._envs.get(ref.path)
        if env is None:
            if not Path(ref.path).exists():
                raise MediaError(Reason.MISSING_MEDIA, f"LMDB {ref.path!r} does not exist")
            import lmdb  # only LMDB media need it (the GPU machine's image has no lmdb)

            env = lmdb.open(ref.path, readonly=True, lock=False, readahead=False, subdir=Path(ref.path).is_dir())
            self._envs[ref.path] = env
        with env.begin(buffers=False) as txn:
            value = txn.get(ref.key.encode("utf-8"))
        if value is None:
            raise MediaError(Reason.MISSING_LMDB_KEY, f"key {ref.key!r} not in LMDB {ref.path!r}")
        return bytes(value)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()


def check_media_roots(ref: MediaRef, *root_sets: tuple[str, ...]) -> None:
    """Raise ``media_outside_root`` unless ``ref``'s file resolves (``..``, symlinks) inside a root of
    every non-empty set (roots already resolved). Sets narrow each other: a dataset config can
    confine its media further than ``--media-root``, never widen it."""
    if not any(root_sets):
        return
    if "://" in ref.path:
        raise MediaError(Reason.MEDIA_OUTSIDE_ROOT, f"{ref.format()}: not a local file, and --media-root is set")
    real = os.path.realpath(ref.path)
    for roots in root_sets:
        if roots and not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
            raise MediaError(
                Reason.MEDIA_OUTSIDE_ROOT,
                f"{ref.format()}: resolves to {real}, outside the media roots {list(roots)}; move the file under one "
                "or add its directory with --media-root",
            )


def read_bytes(ref: MediaRef, pool: LmdbPool) -> bytes:
    """The original encoded bytes of a media item (for verification and shard writing)."""
    if ref.key is not None:
        return pool.get(ref)
    if ref.is_table_cell:
        return _cell(ref)
    with open_media_file(ref.path) as fh:
        return fh.read()


def image_header(ref: MediaRef, pool: LmdbPool, max_pixels: int = DECODE_LIMIT_PIXELS) -> ImageHeader:
    """Size as the processor will see the image and encoded size, from the header only.

    Raises:
        MediaError: ``image_too_large`` past ``max_pixels``; ``corrupt_image``, ``missing_media``.
    """
    if ref.key is not None:
        return _read_header(io.BytesIO(pool.get(ref)), ref.format(), max_pixels)
    if ref.is_table_cell:
        return _read_header(io.BytesIO(_cell(ref)), ref.format(), max_pixels)
    fd = open_image_fd(ref.path)
    try:
        return read_image_file(fd, ref.path, max_pixels, os.fstat(fd))
    finally:
        os.close(fd)


def open_image_fd(path: str) -> int:
    """A descriptor of the file at ``path`` for `read_image_file`, or `MediaError` saying why it cannot
    be opened (missing, a loop, no permission; a directory opens, and `read_image_file` says so)."""
    try:
        return os.open(path, os.O_RDONLY)
    except (OSError, ValueError):
        with _open_file(path, buffering=0) as fh:  # raises the error that says why (or the OSError itself)
            return os.dup(fh.fileno())  # the file appeared meanwhile


def read_image_file(fd: int, path: str, max_pixels: int, st: os.stat_result) -> ImageHeader:
    """`image_header` of the file at ``path`` open as ``fd`` (`open_image_fd`), whose ``fstat`` is ``st``
    (taken before any read, as `prep.sources.header_memo` needs). A regular file is read by position
    (``pread``: no file object, no seeks) and sized by ``st``; anything else (a directory, a device)
    is opened by path and read as a stream, which says why it cannot be read."""
    if not stat.S_ISREG(st.st_mode):
        with _open_file(path, buffering=0) as fh:
            return _read_header(fh, path, max_pixels)
    try:
        header = read_image_fd(fd, max_pixels)
    except _HEADER_ERRORS as exc:
        raise _header_error(exc, path) from exc
    num_bytes = st.st_size
    marker = _END_MARKERS.get(header.format or "")
    if marker is not None:
        start = max(0, num_bytes - 64)
        _check_trailer(marker, os.pread(fd, num_bytes - start, start), header.format, path)
    return _sized(header, num_bytes, path)


@contextmanager
def open_media_file(path: str, buffering: int = -1) -> Iterator[IO[bytes]]:
    """``path`` opened for reading; why it cannot be (missing, a directory, a loop, no permission) as `MediaError`."""
    with _open_file(path, buffering) as fh:
        yield fh


def _open_file(path: str, buffering: int = -1) -> IO[bytes]:
    """`open_media_file` without the generator (a few µs an image header)."""
    try:
        return open(path, "rb", buffering=buffering)
    except FileNotFoundError as exc:
        raise MediaError(Reason.MISSING_MEDIA, f"file {path!r} does not exist") from exc
    except IsADirectoryError as exc:
        raise MediaError(Reason.MISSING_MEDIA, f"{path!r} is a directory, not a file") from exc
    except PermissionError as exc:
        raise MediaError(Reason.MISSING_MEDIA, f"file {path!r}: permission denied") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MediaError(Reason.MISSING_MEDIA, f"{path!r} is a symlink loop") from exc
        raise


def _read_header(fh: IO[bytes], uri: str, max_pixels: int) -> ImageHeader:
    try:
        header = read_image_header(fh, max_pixels)
    except _HEADER_ERRORS as exc:
        raise _header_error(exc, uri) from exc
    num_bytes = fh.seek(0, io.SEEK_END)
    marker = _END_MARKERS.get(header.format or "")
    if marker is not None:
        start = fh.seek(max(0, num_bytes - 64))
        _check_trailer(marker, fh.read(num_bytes - start), header.format, uri)  # one read even unbuffered
    return _sized(header, num_bytes, uri)


_HEADER_ERRORS = (ImageTooLarge, OSError, SyntaxError, ValueError, struct.error)


def _header_error(exc: Exception, uri: str) -> MediaError:
    """Why the header of ``uri`` cannot be read, as an error row says it."""
    if isinstance(exc, ImageTooLarge):
        return MediaError(Reason.IMAGE_TOO_LARGE, f"{uri}: {exc} (a decompression bomb, or a scan to downsize first)")
    if isinstance(exc, UnidentifiedImageError):  # its message embeds a memory address: keep output deterministic
        return MediaError(Reason.CORRUPT_IMAGE, f"{uri}: not a recognised image format")
    return MediaError(Reason.CORRUPT_IMAGE, f"{uri}: not a readable image ({exc})")


def _check_trailer(marker: bytes, tail: bytes, fmt: str | None, uri: str) -> None:
    """Truncated files pass a header read but fail to decode later: the end marker must be in the last bytes."""
    if marker not in tail:
        raise MediaError(Reason.CORRUPT_IMAGE, f"{uri}: truncated {fmt} (no end marker)")


def _sized(header: ImageHeaderInfo, num_bytes: int, uri: str) -> ImageHeader:
    if header.width < 1 or header.height < 1:
        raise MediaError(Reason.CORRUPT_IMAGE, f"{uri}: empty image {header.stored_width}x{header.stored_height}")
    return ImageHeader(width=header.width, height=header.height, num_bytes=num_bytes)


def _cell(ref: MediaRef) -> bytes:
    """Bytes embedded in a table file; a vanished file or cell is ``missing_media``."""
    from prep.sources.tables import TableCellError, cell_bytes  # deferred: pyarrow readers only for tables

    try:
        return cell_bytes(ref)
    except (TableCellError, FileNotFoundError, ConfigError) as exc:
        raise MediaError(Reason.MISSING_MEDIA, f"{ref.format()}: {exc}") from exc


def video_header(ref: MediaRef) -> VideoHeader:
    """Container metadata and file size of a video, without decoding frames."""
    meta, num_bytes = _video(ref)  # raises MediaError unless ref is a readable video file or table cell
    if num_bytes is None:
        num_bytes = os.stat(ref.path).st_size
    return VideoHeader(meta=meta, num_bytes=num_bytes)


def video_meta(ref: MediaRef) -> VideoMeta:
    """Frame count, fps and frame size from the container, without decoding frames.

    MP4/MOV files are read from their ``moov`` box (`packvlm.mp4_header`, ~5x cheaper than
    opening PyAV) where that parser vouches for PyAV's answer; everything else opens PyAV.
    """
    return _video(ref)[0]


def _video(ref: MediaRef) -> tuple[VideoMeta, int | None]:
    """`video_meta`'s answer, and the size of what was read: a table cell's bytes, a regular file's
    ``fstat``; None for anything else (opened as a stream)."""
    if ref.key is not None:
        raise MediaError(Reason.BAD_VIDEO, f"{ref.format()}: videos are read from files, not LMDB")
    source: str | IO[bytes]
    num_bytes = None
    if ref.is_table_cell:
        data = _cell(ref)
        source = cell = io.BytesIO(data)
        num_bytes = len(data)
        header = read_mp4_video(cell)
        cell.seek(0)  # PyAV reads a stream from where it stands
    else:
        header, num_bytes = _file_mp4(ref.path)
        source = ref.path
    if header is not None:  # MP4/MOV whose moov answers exactly what PyAV would
        meta = VideoMeta(num_frames=header.num_frames, fps=header.fps, width=header.width, height=header.height)
        return meta, num_bytes
    return _pyav_meta(source, ref.format()), num_bytes


def _file_mp4(path: str) -> tuple[Mp4Video | None, int | None]:
    """`read_mp4_video` of the file at ``path`` and its size: a regular file opened once, sized by
    ``fstat`` and read by position (`FileBlocks`: two reads for most clips); anything else (missing,
    a directory, a pipe) as `open_media_file` opens it, which says why it cannot be read (av's errors
    do not), with no size."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (OSError, ValueError):
        pass
    else:
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return read_mp4_video(FileBlocks(fd, st.st_size)), st.st_size
        finally:
            os.close(fd)
    with open_media_file(path) as fh:
        return read_mp4_video(fh), None


def _pyav_meta(source: str | IO[bytes], uri: str) -> VideoMeta:
    """What PyAV reports for the first video stream of ``source`` (a path or a stream at its start)."""
    import av  # deferred: PyAV is only needed for datasets with video

    try:
        with av.open(source, mode="r") as container:
            if not container.streams.video:
                raise MediaError(Reason.BAD_VIDEO, f"{uri}: no video stream")
            stream = container.streams.video[0]
            # the same fields transformers' PyAV reader puts in VideoMetadata
            num_frames = int(stream.frames)
            fps = float(stream.average_rate) if stream.average_rate else 0.0
            width, height = stream.width, stream.height
            if num_frames <= 0:  # mkv/webm headers often omit it: count packets, no decoding
                num_frames = sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.FFmpegError as exc:
        raise MediaError(Reason.BAD_VIDEO, f"{uri}: unreadable video ({exc})") from exc
    if num_frames <= 0 or fps <= 0 or width <= 0 or height <= 0:
        raise MediaError(Reason.BAD_VIDEO, f"{uri}: missing frame count/fps/size in container")
    return VideoMeta(num_frames=num_frames, fps=fps, width=width, height=height)
