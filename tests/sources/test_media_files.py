"""Header reads of local files by position (`packvlm.mp4_header.FileBlocks`, `prep.sources.media.read_image_file`):
the same answers, errors and sizes as reading the same bytes through a seekable stream.

The truth is the stream path these replace for regular files: ``read_mp4_video`` on a `io.BytesIO`
of the file's bytes (itself checked against PyAV in ``test_mp4_header``), ``_read_header`` on the
bytes, and ``os.stat`` for sizes. Every cut of a clip and every changed ``moov`` byte is read both
ways, with blocks small enough that reads cross block boundaries.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from packvlm.mp4_header import FileBlocks, read_mp4_video
from prep.example.media import write_video
from prep.sources import header_memo
from prep.sources.header_memo import HeaderMemo
from prep.sources.media import LmdbPool, MediaError, _read_header, image_header, video_header, video_meta
from schemas.media_ref import MediaRef
from tests.sources.test_mp4_header import BASES

LIMIT = 10**9


def _blocks_answer(fd: int, data: bytes, block: int) -> object:
    """``read_mp4_video`` of ``data`` written to the regular file open as ``fd``, read by position."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    return read_mp4_video(FileBlocks(fd, os.fstat(fd).st_size, block))


def _scratch_fd(tmp_path: Path) -> int:
    """A regular file to rewrite thousands of times: in memory where the platform has it."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("clip")
    return os.open(tmp_path / "clip.mp4", os.O_RDWR | os.O_CREAT)


def test_file_blocks_read_what_seek_and_read_return(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for block in (1, 7, 64, 8192):
            blocks, stream = FileBlocks(fd, len(data), block), io.BytesIO(data)
            for pos, n in [(0, 16), (3, 0), (1270, 16), (1279, 9), (1280, 4), (2000, 8), (5, 700), (0, 1280), (64, 64)]:
                stream.seek(pos)
                assert blocks.read_at(pos, n) == stream.read(n), (block, pos, n)
    finally:
        os.close(fd)


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_cut_and_changed_moov_byte_reads_the_same_by_position(base: str, tmp_path: Path) -> None:
    data = BASES[base]()
    start = data.find(b"moov") - 4
    moov = range(start, start + int.from_bytes(data[start : start + 4], "big"))
    variants = [data[:cut] for cut in range(len(data) + 1)]
    variants += [data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :] for pos in moov]
    served, fd = 0, _scratch_fd(tmp_path)
    try:
        for variant in variants:
            truth = read_mp4_video(io.BytesIO(variant))
            for block in (16, 8192):
                assert _blocks_answer(fd, variant, block) == truth
            served += truth is not None
    finally:
        os.close(fd)
    assert served > len(moov) // 2  # the parser answered for most of them, not only handed back


def _clip(path: Path, frames: int, fps: float, size: tuple[int, int]) -> Path:
    return write_video(path, frames, fps, *size)


def test_video_header_sizes_by_the_open_file_and_reads_a_replaced_file_again(tmp_path: Path) -> None:
    path = _clip(tmp_path / "clip.mp4", 12, 25.0, (32, 16))
    ref = MediaRef(path=str(path))
    first = video_header(ref)
    assert first.num_bytes == os.stat(path).st_size
    assert first.meta == video_meta(ref)
    assert (first.meta.num_frames, first.meta.fps, first.meta.width, first.meta.height) == (12, 25.0, 32, 16)
    other = _clip(tmp_path / "other.mp4", 30, 30.0, (48, 32))
    os.replace(other, path)
    second = video_header(ref)
    assert (second.meta.num_frames, second.meta.width, second.num_bytes) == (30, 48, os.stat(path).st_size)


def test_video_errors_are_those_of_the_stream_path(tmp_path: Path) -> None:
    """Missing files and directories fail as ``open_media_file`` says; a device (no ``moov``) goes to PyAV."""
    for bad, reason in [(tmp_path / "nope.mp4", "missing_media"), (tmp_path, "missing_media")]:
        with pytest.raises(MediaError) as err:
            video_header(MediaRef(path=str(bad)))
        assert err.value.reason == reason
        assert str(bad) in str(err.value)
    with pytest.raises(MediaError) as err:
        video_header(MediaRef(path=os.devnull))
    assert err.value.reason == "bad_video"


def _jpeg(path: Path, size: tuple[int, int]) -> Path:
    Image.new("RGB", size, (10, 120, 200)).save(path, quality=90)
    return path


def _png(path: Path, size: tuple[int, int]) -> Path:
    Image.new("RGB", size, (10, 120, 200)).save(path)
    return path


@pytest.mark.parametrize("cut", [None, -2, -30])
@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_image_header_of_a_file_equals_its_bytes_read_as_a_stream(kind: str, cut: int | None, tmp_path: Path) -> None:
    """Sizes from ``fstat`` and the end marker read by position: the answer, or the error, of the bytes."""
    path = {"jpeg": _jpeg, "png": _png}[kind](tmp_path / f"img.{kind}", (40, 30))
    data = path.read_bytes()[:cut]
    path.write_bytes(data)

    def outcome(read: object) -> object:
        try:
            return read()  # type: ignore[operator]
        except MediaError as exc:
            return exc.reason, str(exc)

    got = outcome(lambda: image_header(MediaRef(path=str(path)), LmdbPool(), LIMIT))
    assert got == outcome(lambda: _read_header(io.BytesIO(data), str(path), LIMIT))
    if cut is None:
        assert got.num_bytes == os.stat(path).st_size == len(data)  # type: ignore[union-attr]
    else:
        assert got[0] == "corrupt_image"  # type: ignore[index]
    memo = HeaderMemo()
    assert outcome(lambda: memo.image_header(MediaRef(path=str(path)), LmdbPool(), LIMIT)) == got


def test_a_device_is_read_as_a_stream(tmp_path: Path) -> None:
    with pytest.raises(MediaError) as err:
        image_header(MediaRef(path=os.devnull), LmdbPool())
    with open(os.devnull, "rb", buffering=0) as fh, pytest.raises(MediaError) as truth:
        _read_header(fh, os.devnull, LIMIT)
    assert (err.value.reason, str(err.value)) == (truth.value.reason, str(truth.value))


def test_the_memo_reads_a_file_renamed_over_the_kept_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stamp is the opened file's ``fstat``: a new inode under the same path is read, not served from memory."""
    monkeypatch.setattr(header_memo, "_clock_ns", lambda: 10**20)  # every file settled
    path = _jpeg(tmp_path / "a.jpg", (64, 48))
    memo, pool, ref = HeaderMemo(), LmdbPool(), MediaRef(path=str(path))
    assert (memo.image_header(ref, pool).width, memo.image_header(ref, pool).width) == (64, 64)
    os.replace(_jpeg(tmp_path / "b.jpg", (20, 10)), path)
    got = memo.image_header(ref, pool)
    assert got == image_header(ref, pool) and (got.width, got.num_bytes) == (20, os.stat(path).st_size)


def test_files_that_cannot_be_opened_say_why_as_before(tmp_path: Path) -> None:
    """A missing file, a directory and a symlink loop: ``missing_media`` with the messages of ``open_media_file``,
    for images (with and without the memo) and videos."""
    loop = tmp_path / "loop.jpg"
    loop.symlink_to(loop)
    cases = {
        tmp_path / "nope.jpg": "file {!r} does not exist",
        tmp_path: "{!r} is a directory, not a file",
        loop: "{!r} is a symlink loop",
    }
    for path, message in cases.items():
        ref = MediaRef(path=str(path))
        for read in (
            lambda r: image_header(r, LmdbPool()),
            lambda r: HeaderMemo().image_header(r, LmdbPool()),
            video_header,
        ):
            with pytest.raises(MediaError) as err:
                read(ref)
            assert (err.value.reason, str(err.value)) == ("missing_media", message.format(str(path)))


def test_a_clip_in_a_table_cell_is_read_once_and_sized_by_its_bytes(tmp_path, monkeypatch):
    """A video embedded in a Parquet cell: the file's metadata, the cell's byte count, one cell read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prep.sources import media

    clip = tmp_path / "clip.mp4"
    write_video(clip, 30, 15.0, 64, 48, seed=0)
    data = clip.read_bytes()
    pq.write_table(pa.table({"video": pa.array([data], type=pa.binary())}), tmp_path / "t.parquet")
    ref = MediaRef.table_cell(str(tmp_path / "t.parquet"), 0, ("video",), "clip.mp4")
    reads = []
    real_cell = media._cell
    monkeypatch.setattr(media, "_cell", lambda r: reads.append(r) or real_cell(r))
    got = video_header(ref)
    assert len(reads) == 1  # the size is the bytes read for the header, not a second read of the cell
    assert got.num_bytes == len(data) == os.stat(clip).st_size
    assert got.meta == video_header(MediaRef(path=str(clip))).meta
