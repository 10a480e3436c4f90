"""`prep.sources.header_memo`: a kept header is served only while the file's stat stamp is unchanged.

The oracle is `prep.sources.media.image_header` on the file as it is now. The changes made
here keep the file's size and (with ``os.utime``) its mtime, and the in-place rewrite its inode:
only the ctime, which the kernel sets on every change, tells the memo to read again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from PIL import Image

from prep.sources import header_memo
from prep.sources.header_memo import HeaderMemo
from prep.sources.media import LmdbPool, MediaError, image_header, read_image_file
from schemas.media_ref import MediaRef


def _jpeg(path: Path, size: tuple[int, int]) -> None:
    Image.new("RGB", size, (200, 30, 30)).save(path, quality=90)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every full header read the memo makes."""
    calls: list[str] = []

    def counted(fd: int, path: str, max_pixels: int, st: os.stat_result) -> object:
        calls.append(path)
        return read_image_file(fd, path, max_pixels, st)

    monkeypatch.setattr(header_memo, "read_image_file", counted)
    return calls


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock a minute on: files written by the test count as settled."""
    monkeypatch.setattr(header_memo, "_clock_ns", lambda: time.time_ns() + 60 * 10**9)


def test_settled_file_is_read_once(tmp_path, reads, later):
    path = tmp_path / "a.jpg"
    _jpeg(path, (64, 48))
    memo, pool, ref = HeaderMemo(), LmdbPool(), MediaRef(path=str(path))
    got = [memo.image_header(ref, pool) for _ in range(3)]
    assert got == [image_header(ref, pool)] * 3
    assert reads == [str(path)]
    assert (got[0].width, got[0].height, got[0].num_bytes) == (64, 48, path.stat().st_size)
    memo.image_header(ref, pool, max_pixels=10**6)  # another pixel limit: read again
    assert len(reads) == 2


def test_same_size_rewrite_with_old_mtime_is_read_again(tmp_path, reads, later):
    """64x48 and 48x64 of one colour compress to the same number of bytes: rewritten in place, mtime put back."""
    path = tmp_path / "a.jpg"
    _jpeg(path, (64, 48))
    other = tmp_path / "b.jpg"
    _jpeg(other, (48, 64))
    assert other.stat().st_size == path.stat().st_size
    memo, pool, ref = HeaderMemo(), LmdbPool(), MediaRef(path=str(path))
    before = path.stat()
    assert (memo.image_header(ref, pool).width, memo.image_header(ref, pool).width) == (64, 64)
    with open(path, "r+b") as fh:  # same inode, same size
        fh.write(other.read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    got = memo.image_header(ref, pool)
    assert got == image_header(ref, pool) and (got.width, got.height) == (48, 64)
    assert len(reads) == 2


def test_recent_file_is_read_every_time(tmp_path, reads):
    path = tmp_path / "a.jpg"
    _jpeg(path, (64, 48))
    memo, pool, ref = HeaderMemo(), LmdbPool(), MediaRef(path=str(path))
    for _ in range(3):
        assert memo.image_header(ref, pool) == image_header(ref, pool)
    assert len(reads) == 3


def test_errors_are_not_kept_and_a_vanished_file_is_missing(tmp_path, reads, later):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"\xff\xd8\xff not a jpeg")
    memo, pool, ref = HeaderMemo(), LmdbPool(), MediaRef(path=str(path))
    for _ in range(2):
        with pytest.raises(MediaError) as err:
            memo.image_header(ref, pool)
        assert err.value.reason == "corrupt_image"
    _jpeg(path, (64, 48))
    memo.image_header(ref, pool)
    path.unlink()
    with pytest.raises(MediaError) as err:
        memo.image_header(ref, pool)
    assert err.value.reason == "missing_media"
    with pytest.raises(MediaError) as truth:
        image_header(ref, pool)
    assert str(err.value) == str(truth.value)
    assert len(reads) == 3  # the vanished file fails to open, before any read


def test_oldest_header_leaves_first(tmp_path, reads, later):
    memo, pool = HeaderMemo(max_headers=2), LmdbPool()
    refs = []
    for i in range(3):
        _jpeg(tmp_path / f"{i}.jpg", (10 + i, 10))
        refs.append(MediaRef(path=str(tmp_path / f"{i}.jpg")))
    for ref in [*refs, refs[2], refs[1], refs[0]]:
        assert memo.image_header(ref, pool) == image_header(ref, pool)
    assert reads == [r.path for r in refs] + [refs[0].path]
