"""An image's size and EXIF orientation from its header, refused past a pixel limit before anything decodes.

Both `prep tokenize` (every image of a dataset) and `train`'s loader (every image of a pack)
read headers here, so a decompression bomb (a few KB or MB that decode to gigabytes) costs
neither of them more than its file. Three rules keep pixels undecoded:

- PIL's own bomb check is set to ``max_pixels`` while the file is opened (not switched off):
  plugins that allocate or decode while opening (WebP's animation decoder allocates the canvas;
  ICO and ICNS decode an embedded image) then refuse first, and so does `Image.open` itself
  once the plugin has read the header.
- Nothing that can decode is called before the size is compared with the limit.
- EXIF orientation (which transformers' ``load_image`` applies, swapping width and height for
  tags 5-8) is read without the pixels: PIL's PNG ``getexif`` decodes the whole image to reach
  an ``eXIf`` chunk after the data, so a PNG's orientation is read from a copy holding every
  chunk but the pixel data (`_png_without_pixels`), which PIL reads exactly as the full file.
  JPEG (APP1), WebP (demuxer), TIFF (IFD) and GIF give EXIF from their headers. A TIFF's
  stored size is read from its IFD: recent Pillow reports it already oriented, older did not.

Most images are plain JPEGs: `packvlm.jpeg_header` reads those (size, EXIF and XMP orientation)
without PIL, several times faster, and hands anything it cannot vouch PIL reads the same way
back to the PIL path here. Its size meets the same limit rule (`_check_pixels`), so results and
errors are the same either way.

Example::

    with open("photo.png", "rb") as fh:
        header = read_image_header(fh, max_pixels=178_956_970)
    header.width, header.height  # after orientation
"""

from __future__ import annotations

import io
import os
import re
import struct
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, cast

from PIL import Image, TiffImagePlugin

from packvlm.jpeg_header import JpegHeader, read_jpeg_header

#: where PIL's decoder refuses (`Image.DecompressionBombError`), so what training can decode at all
DECODE_LIMIT_PIXELS = 2 * (Image.MAX_IMAGE_PIXELS or 0)
EXIF_ORIENTATION_TAG = 0x0112
SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
TIFF_WIDTH_TAG, TIFF_LENGTH_TAG = 256, 257
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_PIXEL_CHUNKS = frozenset({b"IDAT", b"fdAT", b"acTL", b"fcTL"})  # pixel data and APNG frame control
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_PIL_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageTooLarge(Exception):
    """The header claims more than ``max_pixels`` pixels; nothing was decoded."""

    def __init__(self, pixels: int, size: tuple[int, int] | None, max_pixels: int) -> None:
        shown = f"{size[0]}x{size[1]} = " if size else ""
        super().__init__(f"{shown}{pixels:,} pixels > --max-image-pixels {max_pixels:,}")
        self.pixels = pixels
        self.size = size


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageHeaderInfo:
    """What the header says: stored size, format and the EXIF orientation tag (1 when absent)."""

    stored_width: int
    stored_height: int
    format: str | None
    orientation: int

    @property
    def width(self) -> int:
        """Width as ``load_image`` returns the image (after EXIF transpose)."""
        return self.stored_height if self.orientation in SWAPPING_ORIENTATIONS else self.stored_width

    @property
    def height(self) -> int:
        return self.stored_width if self.orientation in SWAPPING_ORIENTATIONS else self.stored_height


@contextmanager
def pil_pixel_limit(max_pixels: int) -> Iterator[None]:
    """PIL refuses (`Image.DecompressionBombError`) past ``max_pixels``, silently below it.

    PIL raises above ``2 * MAX_IMAGE_PIXELS`` and warns above ``MAX_IMAGE_PIXELS``; the warning is
    muted here because the caller applies the limit. Not thread-safe (a PIL global), like PIL.
    """
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = (max_pixels + 1) // 2  # raises past max (even) or max + 1 (odd: see the caller)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def open_image_checked(fh: IO[bytes], max_pixels: int) -> Image.Image:
    """``Image.open(fh)`` (header only) refused with `ImageTooLarge` past ``max_pixels``.

    The caller decodes it (``load``) under `pil_pixel_limit` only if it wants the pixels.

    Raises:
        ImageTooLarge: Past ``max_pixels``.
        PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError: Not a readable image.
    """
    with pil_pixel_limit(max_pixels):
        try:
            img = Image.open(fh)
        except Image.DecompressionBombError as exc:
            found = _PIL_PIXELS.search(str(exc))
            raise ImageTooLarge(int(found[1]) if found else max_pixels + 1, None, max_pixels) from exc
    width, height = img.size
    if width * height > max_pixels:  # an odd limit: PIL lets max + 1 through
        img.close()
        raise ImageTooLarge(width * height, (width, height), max_pixels)
    return img


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    """`open_image_checked`'s two refusals for a size read without PIL (both sides at least 1):
    PIL's bomb check under `pil_pixel_limit` (no size in the message), then the odd-limit one."""
    pixels = width * height
    if pixels > 2 * ((max_pixels + 1) // 2):
        raise ImageTooLarge(pixels, None, max_pixels)
    if pixels > max_pixels:
        raise ImageTooLarge(pixels, (width, height), max_pixels)


def read_image_header(fh: IO[bytes], max_pixels: int = DECODE_LIMIT_PIXELS) -> ImageHeaderInfo:
    """Size, format and orientation of the image in ``fh`` without decoding its pixels.

    Raises:
        ImageTooLarge: The header claims more than ``max_pixels``.
        PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError: Not a readable image.
    """
    jpeg = read_jpeg_header(fh)
    if jpeg is not None:
        return _jpeg_info(jpeg, max_pixels)
    if isinstance(fh, io.RawIOBase):  # an unbuffered file (read once above): PIL reads a few bytes at a time
        buffered = io.BufferedReader(fh)
        try:
            return _read_with_pil(buffered, max_pixels)
        finally:
            if not buffered.closed:  # PIL closes it (and so the file) refusing past an odd limit, as before
                buffered.detach()  # the caller's file stays open
    return _read_with_pil(fh, max_pixels)


def read_image_fd(fd: int, max_pixels: int = DECODE_LIMIT_PIXELS) -> ImageHeaderInfo:
    """`read_image_header` of the regular file open as ``fd``, without a file object where it can:
    the JPEG path reads by position (``pread``); anything else goes to `read_image_header` on an
    unbuffered view of ``fd`` (left open)."""
    jpeg = read_jpeg_header(cast(IO[bytes], _Positional(fd)))
    if jpeg is not None:
        return _jpeg_info(jpeg, max_pixels)
    with io.FileIO(fd, "rb", closefd=False) as fh:
        return read_image_header(fh, max_pixels)


class _Positional:
    """What `read_jpeg_header` asks of a file (seek to a position, read forward), as ``pread`` calls."""

    __slots__ = ("fd", "pos")

    def __init__(self, fd: int) -> None:
        self.fd, self.pos = fd, 0

    def seek(self, pos: int) -> int:
        self.pos = pos
        return pos

    def read(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.pos)
        self.pos += len(data)
        return data


def _jpeg_info(jpeg: JpegHeader, max_pixels: int) -> ImageHeaderInfo:
    _check_pixels(jpeg.stored_width, jpeg.stored_height, max_pixels)
    return ImageHeaderInfo(
        stored_width=jpeg.stored_width, stored_height=jpeg.stored_height, format="JPEG", orientation=jpeg.orientation
    )


def _read_with_pil(fh: IO[bytes], max_pixels: int) -> ImageHeaderInfo:
    with open_image_checked(fh, max_pixels) as img:
        width, height = img.size
        fmt = img.format
        if fmt == "PNG":
            orientation = png_orientation(fh)
        else:
            orientation = int(img.getexif().get(EXIF_ORIENTATION_TAG, 1))
        if isinstance(img, TiffImagePlugin.TiffImageFile):  # recent Pillow reports the size oriented
            width, height = img.tag_v2.get(TIFF_WIDTH_TAG, width), img.tag_v2.get(TIFF_LENGTH_TAG, height)
    return ImageHeaderInfo(stored_width=width, stored_height=height, format=fmt, orientation=orientation)


def png_orientation(fh: IO[bytes]) -> int:
    """The EXIF orientation PIL finds in a PNG once loaded (``eXIf`` or text chunks, before or after
    the pixel data), read from a copy without the pixel data."""
    with Image.open(io.BytesIO(_png_without_pixels(fh))) as copy:
        copy.load()  # a 1x1 image: decoding it reads the chunks after its data, as the full load would
        return int(copy.getexif().get(EXIF_ORIENTATION_TAG, 1))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_without_pixels(fh: IO[bytes]) -> bytes:
    """The PNG in ``fh`` as a 1x1 image: the same chunks in the same order (their CRCs as stored),
    the pixel data replaced by one row of zeros; APNG frame chunks dropped. Skips pixel data by
    seeking, so it costs a few reads per chunk whatever the image size."""
    fh.seek(0)
    if fh.read(8) != PNG_SIGNATURE:
        raise SyntaxError("not a PNG file")
    out = [PNG_SIGNATURE]
    wrote_pixels = False
    bytes_per_row = 8  # set from IHDR, which PIL requires first
    while head := fh.read(8):
        if len(head) < 8:
            break
        length, kind = struct.unpack(">I4s", head)
        if kind in _PNG_PIXEL_CHUNKS:
            if kind == b"fcTL" and wrote_pixels:
                break  # PIL stops loading frame 0 at the next frame's control chunk
            fh.seek(length + 4, io.SEEK_CUR)
            if kind == b"IDAT" and not wrote_pixels:
                out.append(_png_chunk(b"IDAT", zlib.compress(b"\0" * (1 + bytes_per_row))))
                wrote_pixels = True
            continue
        data = fh.read(length + 4)
        if kind == b"IHDR":
            _, _, depth, colour, compression, filtering, _ = struct.unpack(">IIBBBBB", data[:13])
            bytes_per_row = -(-_PNG_CHANNELS.get(colour, 4) * depth // 8)
            out.append(_png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, depth, colour, compression, filtering, 0)))
            continue
        out.append(head + data)
        if kind == b"IEND":
            break
    return b"".join(out)
