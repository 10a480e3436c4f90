"""Media fixtures: header sizes, EXIF orientation, broken files, LMDB and video round trips."""

from __future__ import annotations

import io
from pathlib import Path

import av
import lmdb
import pytest
from PIL import Image, ImageOps, UnidentifiedImageError

from prep.example.media import (
    IMAGE_SPECS,
    make_image_bytes,
    write_corrupt_video,
    write_image_files,
    write_lmdb,
    write_video,
)


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG")],
)
def test_image_bytes_have_requested_size_mode_and_format(mode: str, fmt: str) -> None:
    data = make_image_bytes(333, 517, mode=mode, fmt=fmt, seed=4)
    image = Image.open(io.BytesIO(data))
    assert (image.size, image.mode, image.format) == ((333, 517), mode, fmt)
    assert data == make_image_bytes(333, 517, mode=mode, fmt=fmt, seed=4)
    assert data != make_image_bytes(333, 517, mode=mode, fmt=fmt, seed=5)


@pytest.mark.parametrize(
    ("orientation", "swapped"), [(1, False), (3, False), (5, True), (6, True), (7, True), (8, True)]
)
def test_exif_orientation_swaps_size_after_transpose(orientation: int, swapped: bool) -> None:
    image = Image.open(io.BytesIO(make_image_bytes(640, 480, exif_orientation=orientation)))
    assert image.size == (640, 480)  # the header keeps the stored size
    assert image.getexif()[0x0112] == orientation
    assert ImageOps.exif_transpose(image).size == ((480, 640) if swapped else (640, 480))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_image_files(tmp_path_factory.mktemp("images"))


def test_image_assortment_sizes(images: dict[str, Path]) -> None:
    assert set(IMAGE_SPECS) | {"corrupt_garbage", "corrupt_truncated"} == set(images)
    for name, (suffix, spec) in IMAGE_SPECS.items():
        with Image.open(images[name]) as image:
            assert images[name].suffix == suffix
            assert image.size == (spec["width"], spec["height"])
    wide, too_wide = (
        Image.open(images["wide_3000x16"]).size,
        Image.open(images["too_wide_4100x20"]).size,
    )
    assert wide[0] / wide[1] <= 200 < too_wide[0] / too_wide[1]
    assert Image.open(images["rgba_300x200"]).mode == "RGBA"
    assert ImageOps.exif_transpose(Image.open(images["exif_rot8_640x480"])).size == (480, 640)


def test_corrupt_images_fail_to_decode(images: dict[str, Path]) -> None:
    with pytest.raises(UnidentifiedImageError):
        Image.open(images["corrupt_garbage"])
    truncated = Image.open(images["corrupt_truncated"])
    assert truncated.size == (320, 240)  # header is intact
    with pytest.raises(OSError, match="truncated"):
        truncated.load()


def test_qwen_smart_resize_rejects_only_the_too_wide_image(images: dict[str, Path]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for name in ("wide_3000x16", "pixel_1x1", "tiny_10x10", "photo_4000x3000"):
        width, height = Image.open(images[name]).size
        smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056)
    width, height = Image.open(images["too_wide_4100x20"]).size
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056)


def test_lmdb_round_trips_bytes_and_is_deterministic(tmp_path: Path) -> None:
    items = {"a.jpg": make_image_bytes(64, 48), "nested/图片.png": b"\x00\xffraw", "empty": b""}
    first, second = write_lmdb(tmp_path / "a.lmdb", items), write_lmdb(tmp_path / "b.lmdb", items)
    assert sorted(p.name for p in first.iterdir()) == ["data.mdb"]
    assert (first / "data.mdb").read_bytes() == (second / "data.mdb").read_bytes()
    env = lmdb.open(str(first), readonly=True, lock=False)
    with env.begin() as txn:
        assert {k.decode(): bytes(v) for k, v in txn.cursor()} == items
        assert txn.get(b"missing") is None
    env.close()


@pytest.mark.parametrize(
    ("name", "num_frames", "fps", "width", "height"),
    [("a.mp4", 8, 4.0, 64, 48), ("b.mp4", 25, 12.5, 128, 96), ("c.avi", 9, 3.0, 64, 48)],
)
def test_video_frame_count_and_fps_read_back(tmp_path, name, num_frames, fps, width, height) -> None:
    path = write_video(tmp_path / name, num_frames, fps, width, height, seed=1)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.frames == num_frames
        assert float(stream.average_rate) == pytest.approx(fps)
        assert (stream.codec_context.width, stream.codec_context.height) == (width, height)
        assert sum(1 for _ in container.decode(video=0)) == num_frames
    assert (
        path.read_bytes()
        == write_video(tmp_path / f"again_{name}", num_frames, fps, width, height, seed=1).read_bytes()
    )


@pytest.mark.parametrize("suffix", [".mkv", ".webm"])
def test_header_without_frame_count_still_decodes_all_frames(tmp_path: Path, suffix: str) -> None:
    path = write_video(tmp_path / f"v{suffix}", 6, 2.0, 64, 48)
    with av.open(str(path)) as container:
        assert float(container.streams.video[0].average_rate) == pytest.approx(2.0)
        assert sum(1 for _ in container.decode(video=0)) == 6


def test_video_rejects_odd_sizes_and_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        write_video(tmp_path / "odd.mp4", 4, 2.0, 63, 48)
    with pytest.raises(ValueError, match="suffix"):
        write_video(tmp_path / "x.gif", 4, 2.0, 64, 48)


def test_corrupt_video_does_not_open(tmp_path: Path) -> None:
    path = write_corrupt_video(tmp_path / "bad.mp4")
    with pytest.raises(av.error.FFmpegError):
        av.open(str(path))
