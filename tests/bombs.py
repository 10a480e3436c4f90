"""Decompression bombs with real compressed streams, made in well under a second each.

Each writer takes the side (pixels) and makes a file a decoder turns into ``side x side``
pixels of one grey (or transparent, WebP) value, so the same writer at a small side is
checked to decode (`tests/e2e/test_bombs.py`): the big files are real images, not headers
over nothing. At 20,000 x 20,000: PNG 0.4 MB, JPEG 4.7 MB, GIF 0.15 MB, TIFF 0.4 MB (deflate),
WebP < 1 KB (an animation whose canvas the decoder allocates at 4 bytes a pixel).
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

from PIL import Image

ZERO_BLOCK = 1 << 22  # bytes of zeros deflated at once


def zeros_deflate(num_bytes: int) -> bytes:
    """A zlib stream of ``num_bytes`` zeros: one block compressed, its bytes repeated.

    After a full flush deflate restarts from an empty window, so compressing the same block
    again gives the same bytes; the stream ends with an empty final block and the Adler-32 of
    zeros (a = 1, b = n mod 65521), so nothing of size ``num_bytes`` is ever allocated.
    """
    whole, rest = divmod(num_bytes, ZERO_BLOCK)
    comp = zlib.compressobj(9)
    first = comp.compress(b"\0" * ZERO_BLOCK) + comp.flush(zlib.Z_FULL_FLUSH) if whole else b""
    again = comp.compress(b"\0" * ZERO_BLOCK) + comp.flush(zlib.Z_FULL_FLUSH) if whole > 1 else b""
    if not whole:
        return zlib.compress(b"\0" * rest, 9)
    tail = comp.compress(b"\0" * rest) + comp.flush(zlib.Z_FULL_FLUSH) if rest else b""
    adler = (num_bytes % 65521) << 16 | 1
    return first + again * (whole - 1) + tail + b"\x03\x00" + struct.pack(">I", adler)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png_bomb(path: Path, side: int) -> Path:
    """8-bit grey, every row filter 0 and zero pixels."""
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    data = zeros_deflate(side * (side + 1))
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")
    )
    return path


def write_jpeg_bomb(path: Path, side: int) -> Path:
    """Baseline grey JPEG of value 128: per 8x8 block DC difference 0 (code ``00``) then EOB (``1010``)
    under the standard Huffman tables libjpeg writes; the header is PIL's for an 8x8 image, resized."""
    assert side % 32 == 0, "whole blocks, and four blocks per three bytes"
    small = io.BytesIO()
    Image.new("L", (8, 8), 128).save(small, "JPEG", quality=90)
    raw = small.getvalue()
    sof = raw.index(b"\xff\xc0")
    raw = raw[: sof + 5] + struct.pack(">HH", side, side) + raw[sof + 9 :]
    sos = raw.index(b"\xff\xda")
    scan_start = sos + 2 + struct.unpack(">H", raw[sos + 2 : sos + 4])[0]
    blocks = (side // 8) ** 2
    path.write_bytes(raw[:scan_start] + b"\x28\xa2\x8a" * (blocks // 4) + b"\xff\xd9")
    return path


def _lzw_zero_codes(num_pixels: int, min_code_size: int) -> bytes:
    """GIF LZW data for ``num_pixels`` zeros: codes for runs 1, 2, 3, ... until the table is
    full, then the longest run again and again (a deferred clear), packed LSB first."""
    clear = 1 << min_code_size
    next_code, width = clear + 2, min_code_size + 1
    acc = nbits = 0
    out = bytearray()

    def emit(code: int) -> None:
        nonlocal acc, nbits
        acc |= code << nbits
        nbits += width
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8

    def emit_and_grow(code: int) -> None:
        """Emit, then mirror the decoder's table: it adds one entry per code (one code behind
        the encoder) and widens codes after adding entry 2^width - 1, until 4096 entries."""
        nonlocal next_code, width
        emit(code)
        if next_code < 4096:
            next_code += 1
            if next_code == (1 << width) + 1 and width < 12:
                width += 1

    emit(clear)
    left, run, longest = num_pixels, 1, 1
    while left:
        if next_code < 4096 and left >= run:
            emit_and_grow(0 if run == 1 else next_code - 1)  # the entry added last: a run of `run` zeros
            left -= run
            longest, run = run, run + 1
            continue
        take = min(left, longest)
        emit_and_grow(0 if take == 1 else clear + take)  # entry clear + k holds a run of k zeros
        left -= take
    emit(clear + 1)
    if nbits:
        out.append(acc & 0xFF)
    return bytes(out)


def write_gif_bomb(path: Path, side: int) -> Path:
    """GIF89a, two-colour palette, every pixel index 0."""
    lzw = _lzw_zero_codes(side * side, 2)
    blocks = b"".join(bytes([len(lzw[i : i + 255])]) + lzw[i : i + 255] for i in range(0, len(lzw), 255))
    head = b"GIF89a" + struct.pack("<HHBBB", side, side, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    image = b"," + struct.pack("<HHHHB", 0, 0, side, side, 0) + b"\x02" + blocks + b"\x00"
    path.write_bytes(head + image + b";")
    return path


def write_tiff_bomb(path: Path, side: int) -> Path:
    """Little-endian TIFF, 8-bit grey, one Adobe-deflate strip of zeros."""
    data = zeros_deflate(side * side)
    tags = [  # (tag, type, count, value): SHORT = 3, LONG = 4
        (256, 4, 1, side),
        (257, 4, 1, side),
        (258, 3, 1, 8),
        (259, 3, 1, 8),  # Adobe deflate
        (262, 3, 1, 1),  # black is zero
        (273, 4, 1, 8),  # the strip right after the header
        (277, 3, 1, 1),
        (278, 4, 1, side),
        (279, 4, 1, len(data)),
    ]
    ifd_offset = 8 + len(data) + len(data) % 2
    ifd = struct.pack("<H", len(tags))
    for tag, kind, count, value in tags:
        ifd += struct.pack("<HHI", tag, kind, count) + struct.pack(
            "<HH" if kind == 3 else "<I", *((value, 0) if kind == 3 else (value,))
        )
    ifd += struct.pack("<I", 0)
    path.write_bytes(b"II*\x00" + struct.pack("<I", ifd_offset) + data + b"\0" * (len(data) % 2) + ifd)
    return path


def write_webp_bomb(path: Path, side: int) -> Path:
    """An animated WebP (two real 16x16 VP8L frames) whose VP8X canvas is ``side x side``."""
    frames = [Image.new("RGBA", (16, 16), (0, 0, 0, 0)), Image.new("RGBA", (16, 16), (0, 0, 0, 1))]
    buf = io.BytesIO()
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=100)
    raw = bytearray(buf.getvalue())
    vp8x = raw.index(b"VP8X")
    raw[vp8x + 12 : vp8x + 18] = (side - 1).to_bytes(3, "little") + (side - 1).to_bytes(3, "little")
    path.write_bytes(bytes(raw))
    return path


BOMB_WRITERS: dict[str, Callable[[Path, int], Path]] = {
    "png": write_png_bomb,
    "jpg": write_jpeg_bomb,
    "webp": write_webp_bomb,
    "gif": write_gif_bomb,
    "tif": write_tiff_bomb,
}
