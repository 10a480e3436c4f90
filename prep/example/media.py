"""Deterministic image, LMDB and video fixtures, including the broken ones readers must survive.

Pixels come from seeded numpy (smooth gradients plus a seeded pattern, so JPEGs stay small
and fast to encode); no clock, no global random state. Same arguments, same bytes.

``write_image_files(dir)`` names (width x height as stored in the file header)::

    photo_640x480 .. photo_4000x3000   plain RGB JPEGs
    wide_3000x16                       aspect 187.5: inside Qwen's 200:1 limit
    too_wide_4100x20                   aspect 205: the Qwen image processor raises ValueError
    exif_rot6_640x480, exif_rot8_...   EXIF orientation 6/8: 480x640 after exif_transpose
    rgba_300x200 (PNG), gray_256x256 (L), cmyk_200x150, pixel_1x1, tiny_10x10
    corrupt_garbage                    random bytes, not an image at all
    corrupt_truncated                  valid JPEG header (size readable), data cut off
"""

from __future__ import annotations

import io
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

EXIF_ORIENTATION_TAG = 0x0112
# Suffix -> (container format, default codec). MPEG-4 Part 2 and VP9 encode byte-identically
# on every call; libx264 (also available) varied between calls in one process, so it is
# only used when asked for.
VIDEO_FORMATS = {
    ".mp4": ("mp4", "mpeg4"),
    ".mkv": ("matroska", "mpeg4"),
    ".avi": ("avi", "mpeg4"),
    ".webm": ("webm", "libvpx-vp9"),
}


def _pixels(width: int, height: int, seed: int) -> np.ndarray:
    """An RGB uint8 array: seeded gradients and stripes (compresses well, never constant).

    Built from one row and one column by broadcasting, so 4000x3000 costs ~0.1 s.
    """
    rng = np.random.default_rng(seed)
    phase, freq = rng.integers(0, 256, size=3), int(rng.integers(1, 9))
    x = np.arange(width, dtype=np.float64) / max(width, 1)
    y = np.arange(height, dtype=np.float64) / max(height, 1)
    row0 = ((phase[0] + 255 * x) % 256).astype(np.uint8)
    col1 = ((phase[1] + 255 * y) % 256).astype(np.uint8)
    row2 = (127 * (1 + np.sin(2 * np.pi * freq * x))).astype(np.uint8)
    col2 = ((phase[2] + 127 * (1 + np.cos(2 * np.pi * freq * y))) % 256).astype(np.uint8)
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0] = row0[None, :]
    out[..., 1] = col1[:, None]
    out[..., 2] = row2[None, :] + col2[:, None]  # uint8 wraps mod 256
    return out


def make_image_bytes(
    width: int,
    height: int,
    mode: str = "RGB",
    fmt: str = "JPEG",
    exif_orientation: int | None = None,
    seed: int = 0,
) -> bytes:
    """Encode a deterministic ``width`` x ``height`` image (size as stored in the header).

    Args:
        width: Stored width in pixels.
        height: Stored height in pixels.
        mode: PIL mode: "RGB", "RGBA", "L", "CMYK", "P".
        fmt: PIL format: "JPEG", "PNG", "WEBP", ...
        exif_orientation: EXIF orientation tag (1-8) to write; 5-8 make
            ``ImageOps.exif_transpose`` swap width and height.
        seed: Pattern seed.
    """
    image = Image.fromarray(_pixels(width, height, seed))
    if mode == "RGBA":
        alpha = Image.linear_gradient("L").resize((width, height))
        image.putalpha(alpha)
    elif mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    kwargs: dict[str, object] = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION_TAG] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    if fmt == "JPEG":
        kwargs["quality"] = 85
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def garbage_bytes(num_bytes: int, seed: int = 0) -> bytes:
    """Seeded random bytes: a file no image or video decoder recognises."""
    return np.random.default_rng(seed).integers(0, 256, size=num_bytes, dtype=np.uint8).tobytes()


# name -> (file suffix, make_image_bytes kwargs); garbage/truncated are added separately.
IMAGE_SPECS: dict[str, tuple[str, dict[str, object]]] = {
    "photo_640x480": (".jpg", {"width": 640, "height": 480}),
    "photo_1024x768": (".jpg", {"width": 1024, "height": 768}),
    "photo_333x517": (".jpg", {"width": 333, "height": 517}),
    "photo_4000x3000": (".jpg", {"width": 4000, "height": 3000}),
    "wide_3000x16": (".jpg", {"width": 3000, "height": 16}),
    "too_wide_4100x20": (".jpg", {"width": 4100, "height": 20}),
    "exif_rot6_640x480": (".jpg", {"width": 640, "height": 480, "exif_orientation": 6}),
    "exif_rot8_640x480": (".jpg", {"width": 640, "height": 480, "exif_orientation": 8}),
    "rgba_300x200": (".png", {"width": 300, "height": 200, "mode": "RGBA", "fmt": "PNG"}),
    "gray_256x256": (".jpg", {"width": 256, "height": 256, "mode": "L"}),
    "cmyk_200x150": (".jpg", {"width": 200, "height": 150, "mode": "CMYK"}),
    "pixel_1x1": (".jpg", {"width": 1, "height": 1}),
    "tiny_10x10": (".jpg", {"width": 10, "height": 10}),
}


def write_image_files(out_dir: Path) -> dict[str, Path]:
    """Write the named assortment of images (see module docstring); returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for index, (name, (suffix, kwargs)) in enumerate(IMAGE_SPECS.items()):
        path = out_dir / f"{name}{suffix}"
        path.write_bytes(make_image_bytes(**kwargs, seed=index))  # type: ignore[arg-type]
        paths[name] = path
    paths["corrupt_garbage"] = out_dir / "corrupt_garbage.jpg"
    paths["corrupt_garbage"].write_bytes(garbage_bytes(2048, seed=1))
    paths["corrupt_truncated"] = out_dir / "corrupt_truncated.jpg"
    jpeg = make_image_bytes(320, 240, seed=2)
    start_of_scan = jpeg.index(b"\xff\xda")  # header complete, entropy data cut short
    paths["corrupt_truncated"].write_bytes(jpeg[: start_of_scan + 256])
    return paths


def write_lmdb(path: Path, items: dict[str, bytes]) -> Path:
    """Store encoded bytes under utf-8 keys in an LMDB directory, in sorted key order.

    Written without a lock file so the directory holds only the deterministic ``data.mdb``;
    open it with ``lmdb.open(path, readonly=True, lock=False)``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    total = sum(len(k.encode()) + len(v) for k, v in items.items())
    map_size = 1 << max(24, (4 * total + (1 << 20)).bit_length())
    import lmdb  # imported where used: the GPU machine's image has neither lmdb nor av

    env = lmdb.open(str(path), map_size=map_size, subdir=True, lock=False, sync=True)
    try:
        with env.begin(write=True) as txn:
            for key in sorted(items):
                txn.put(key.encode("utf-8"), items[key])
    finally:
        env.close()
    return path


def _frame_yuv420p(index: int, num_frames: int, base: np.ndarray) -> np.ndarray:
    """Frame ``index`` as a planar yuv420p array (H*3/2, W): base pattern plus a moving bar.

    Colour conversion is done here (BT.601) rather than by PyAV's swscale, whose output
    differed between encoders in one process and broke byte-identical files.
    """
    height, width, _ = base.shape
    rgb = np.roll(base, shift=index * 3, axis=1).astype(np.float32)
    bar = int(index * (width - 4) / max(num_frames - 1, 1))
    rgb[:, bar : bar + 4] = 255.0
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
    u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
    v = 128 + 0.439 * r - 0.368 * g - 0.071 * b

    def half(plane: np.ndarray) -> np.ndarray:
        return plane.reshape(height // 2, 2, width // 2, 2).mean(axis=(1, 3))

    planes = np.concatenate([y.ravel(), half(u).ravel(), half(v).ravel()])
    return np.clip(np.rint(planes), 0, 255).astype(np.uint8).reshape(height * 3 // 2, width)


def write_video(
    path: Path,
    num_frames: int,
    fps: float,
    width: int,
    height: int,
    codec: str | None = None,
    seed: int = 0,
) -> Path:
    """Encode ``num_frames`` deterministic frames at ``fps`` with PyAV.

    The container follows the suffix (.mp4, .mkv, .avi, .webm); ``codec`` defaults to the
    suffix's entry in ``VIDEO_FORMATS``. Width and height must be even (yuv420p).
    """
    path = Path(path)
    if path.suffix not in VIDEO_FORMATS:
        raise ValueError(f"unsupported video suffix {path.suffix!r}; use one of {sorted(VIDEO_FORMATS)}")
    container_format, default_codec = VIDEO_FORMATS[path.suffix]
    if width % 2 or height % 2:
        raise ValueError(f"yuv420p needs even width and height, got {width}x{height}")
    rate = Fraction(fps).limit_denominator(1001)
    base = _pixels(width, height, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    # bitexact: no random segment UID / date in Matroska, no version strings in headers.
    import av

    with av.open(str(path), "w", format=container_format, options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(codec or default_codec, rate=rate)
        assert isinstance(stream, av.VideoStream)  # narrows the type: a video codec gives a video stream
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = 1 / rate
        stream.codec_context.thread_count = 1
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(_frame_yuv420p(index, num_frames, base), format="yuv420p")
            frame.pts, frame.time_base = index, stream.codec_context.time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_corrupt_video(path: Path, num_bytes: int = 4096, seed: int = 3) -> Path:
    """Random bytes under a video suffix: opening it with PyAV fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(garbage_bytes(num_bytes, seed=seed))
    return path
