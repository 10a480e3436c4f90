"""Tar writing, shard layout and the packed schema, against the stdlib and hand-made data."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from prep.pack.shard_cut import ShardSize, ShardSizeError, cut_shards, estimate_pack_bytes, parse_shard_size
from prep.shards.tar import iter_pack_metas, write_tar_atomic
from schemas.packed import PackedMedia, PackedSampleMeta, PackMeta, media_extension, media_member, pack_key


def _stdlib_tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_equals_stdlib_tarfile_with_fixed_metadata(tmp_path: Path):
    samples = [[("k-1.json", b'{"a":1}'), ("k-1.bin", b"x" * 513)], [("k-2.json", b"{}"), ("k-2.img0000.jpg", b"")]]
    path = tmp_path / "s.tar"
    nbytes, sha256 = write_tar_atomic(path, samples)
    expected = _stdlib_tar(
        [("k-1.bin", b"x" * 513), ("k-1.json", b'{"a":1}'), ("k-2.img0000.jpg", b""), ("k-2.json", b"{}")]
    )
    assert path.read_bytes() == expected and nbytes == len(expected)
    assert sha256 == hashlib.sha256(expected).hexdigest()  # hashed as written, equal to the file
    assert [p.name for p in tmp_path.iterdir()] == ["s.tar"]


def test_killed_write_leaves_no_final_file(tmp_path: Path):
    def samples():
        yield [("a.json", b"{}")]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_tar_atomic(tmp_path / "s.tar", samples())
    assert list(tmp_path.iterdir()) == []


def test_iter_pack_metas_reads_only_json_members(tmp_path: Path):
    members = [
        ("pack-00000001.json", b'{"n": 1}'),
        ("pack-00000001.input_ids.npy", b"\0" * 600),
        ("pack-00000002.json", b"[]"),
    ]
    (tmp_path / "std.tar").write_bytes(_stdlib_tar(members))
    write_tar_atomic(tmp_path / "s.tar", [members[:2], members[2:]])
    for name in ("std.tar", "s.tar"):
        assert list(iter_pack_metas(tmp_path / name)) == [("pack-00000001", {"n": 1}), ("pack-00000002", [])]
    data = (tmp_path / "s.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:700])
    with pytest.raises(ValueError, match="truncated"):
        list(iter_pack_metas(tmp_path / "cut.tar"))
    (tmp_path / "bad.tar").write_bytes(data[:100] + b"X" + data[101:])
    with pytest.raises(ValueError, match="bad tar header"):
        list(iter_pack_metas(tmp_path / "bad.tar"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", ShardSize(max_bytes=512 * 10**6)),
        ("1GiB", ShardSize(max_bytes=2**30)),
        ("4096B", ShardSize(max_bytes=4096)),
        ("1000packs", ShardSize(max_packs=1000)),
        ("1.5 kb", ShardSize(max_bytes=1500)),
    ],
)
def test_parse_shard_size(text: str, expected: ShardSize):
    assert parse_shard_size(text) == expected


@pytest.mark.parametrize("text", ["", "12 apples", "0packs", "1.5packs", "0MB", "-3MB", "10"])
def test_parse_shard_size_rejects(text: str):
    with pytest.raises(ShardSizeError):
        parse_shard_size(text)


def test_cut_shards_never_empty():
    assert cut_shards(np.full(5, 300), ShardSize(max_bytes=700)).tolist() == [0, 2, 4, 5]
    assert cut_shards(np.array([5000, 1, 1]), ShardSize(max_bytes=10)).tolist() == [0, 1, 3]
    assert cut_shards(np.ones(7, np.int64), ShardSize(max_packs=3)).tolist() == [0, 3, 6, 7]
    assert cut_shards(np.zeros(0, np.int64), ShardSize(max_packs=3)).tolist() == [0]
    assert cut_shards(np.zeros(0, np.int64), ShardSize(max_bytes=3)).tolist() == [0]


def test_estimate_counts_arrays_exactly_and_media():
    offsets, items = np.array([0, 2, 3]), np.array([2, 0, 1])
    tokens, media_bytes, media_count = np.array([100, 200, 300]), np.array([0, 1000, 0]), np.array([0, 1, 0])
    est = estimate_pack_bytes(offsets, items, tokens, media_bytes, media_count)
    bare = estimate_pack_bytes(offsets, items, tokens, np.zeros(3, np.int64), np.zeros(3, np.int64))
    # pack 0: samples 2 + 0 (400 tokens, no media); pack 1: sample 1 (200 tokens + a 1000 B image)
    assert est[0] == bare[0] and est[1] - bare[1] >= 1000 + 512
    npy_members = (512 + 2048) + (512 + 1024)  # int32 + uint8 arrays of 400 tokens, 128 B headers
    assert npy_members < est[0] < npy_members + 2048


def test_media_names():
    assert media_extension("/d/a.JPG") == "jpg"
    assert media_extension("/d/images.lmdb::nested/图片_01.jpg") == "jpg"
    assert media_extension("/d/noext") == "bin" and media_extension("/d/x.tar.gz") == "gz"
    assert media_member("video", 3, "/v/c.mp4") == "vid0003.mp4"
    assert pack_key(12) == "pack-00000012" and "." not in pack_key(10**9)


def test_pack_meta_json_round_trip():
    meta = PackMeta(
        key="pack-00000000",
        num_tokens=5,
        cu_seqlens=(0, 2, 5),
        cu_seqlens_padded=(0, 4, 8),
        samples=(
            PackedSampleMeta(input=0, sample_id="a:1:0", dataset="a", num_tokens=2, media=(0,)),
            PackedSampleMeta(input=0, sample_id="a:2:0", dataset="a", num_tokens=3),
        ),
        media=(
            PackedMedia(
                kind="video",
                ref="/v.mp4",
                member="vid0000.mp4",
                sample=0,
                grid_thw=(2, 4, 4),
                num_tokens=8,
                frame_indices=(0, 2),
                timestamps=(0.0, 0.5),
            ),
        ),
    )
    import dataclasses
    import json

    assert PackMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta
    assert json.dumps(meta.to_json(), sort_keys=True) == json.dumps(dataclasses.asdict(meta), sort_keys=True)
    with pytest.raises(ValueError, match="version"):
        PackMeta.from_json({**meta.to_json(), "version": 99})


def test_write_error_on_the_writer_thread_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import prep.shards.tar as tar

    def full_disk(fd: int, parts: list) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tar, "_writev_all", full_disk)
    many = ([(f"k-{i}.bin", b"x" * 100)] for i in range(100))  # more packs than the queue holds: no deadlock
    with pytest.raises(OSError, match="No space left"):
        write_tar_atomic(tmp_path / "s.tar", many)
    assert list(tmp_path.iterdir()) == []
