"""`packvlm.image_header`: the size and orientation read without pixels equal what transformers'
``load_image`` (a full decode, then ``exif_transpose``) returns, for every place EXIF can sit."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image

from packvlm.image_header import ImageTooLarge, read_image_header

WIDTH, HEIGHT = 30, 20


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _image(mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH, 3), np.uint8)).convert(mode)


def _encoded(fmt: str, orientation: int) -> bytes:
    buf = io.BytesIO()
    _image().save(buf, fmt, exif=_exif(orientation))
    return buf.getvalue()


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        out.append((png[pos + 4 : pos + 8], png[pos : pos + 12 + length]))
        pos += 12 + length
    return out


def _png_exif_after_pixels(orientation: int) -> bytes:
    """A PNG whose ``eXIf`` chunk follows the pixel data (PIL's ``getexif`` decodes to reach it)."""
    chunks = _chunks(_encoded("PNG", orientation))
    exif = [raw for kind, raw in chunks if kind == b"eXIf"]
    rest = [(kind, raw) for kind, raw in chunks if kind != b"eXIf"]
    end = [kind for kind, _ in rest].index(b"IEND")
    return b"\x89PNG\r\n\x1a\n" + b"".join(raw for _, raw in rest[:end]) + exif[0] + rest[end][1]


def _png_raw_profile(orientation: int) -> bytes:
    """A PNG carrying EXIF as ImageMagick does: a ``Raw profile type exif`` text chunk after the pixels."""
    exif_hex = _exif(orientation).tobytes().hex()
    text = f"\nexif\n{len(exif_hex) // 2}\n{exif_hex}\n".encode()
    data = b"Raw profile type exif\0" + text
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    buf = io.BytesIO()
    _image().save(buf, "PNG")
    png = buf.getvalue()
    return png[:-12] + chunk + png[-12:]


CASES = {
    "png eXIf before pixels": lambda o: _encoded("PNG", o),
    "png eXIf after pixels": _png_exif_after_pixels,
    "png raw profile text": _png_raw_profile,
    "jpeg APP1": lambda o: _encoded("JPEG", o),
    "webp": lambda o: _encoded("WEBP", o),
    "tiff": lambda o: _encoded("TIFF", o),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_size_after_orientation_equals_a_full_decode(case: str, orientation: int) -> None:
    data = CASES[case](orientation)
    truth = load_image(Image.open(io.BytesIO(data))).size  # decodes, then exif_transpose
    header = read_image_header(io.BytesIO(data))
    assert (header.width, header.height) == truth
    assert header.orientation == orientation
    assert truth == ((HEIGHT, WIDTH) if orientation in (6, 8) else (WIDTH, HEIGHT))  # the case is not vacuous


@pytest.mark.parametrize("limit", [WIDTH * HEIGHT - 1, WIDTH * HEIGHT - 2])  # PIL's own check rounds to even
def test_one_pixel_past_the_limit_is_too_large_and_the_limit_itself_is_not(limit: int) -> None:
    data = _encoded("PNG", 1)
    with pytest.raises(ImageTooLarge, match=f"{WIDTH * HEIGHT:,} pixels > --max-image-pixels {limit:,}"):
        read_image_header(io.BytesIO(data), max_pixels=limit)
    assert read_image_header(io.BytesIO(data), max_pixels=WIDTH * HEIGHT).width == WIDTH
