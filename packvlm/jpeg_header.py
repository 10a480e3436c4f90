"""A JPEG's size and EXIF orientation from its marker segments, as PIL reads them, in pure Python.

`read_image_header` costs ~25 µs per JPEG through PIL (``Image.open``, its EXIF and DPI parsing,
the MPO probe); `prep tokenize` reads every image of a dataset this way, so that was a fifth to a
third of its whole per-sample cost. This module walks the segments up to the start of scan itself
and serves the file only when it can vouch that PIL would give the same answer; anything it does
not fully follow returns ``None`` and the caller asks PIL. What it vouches for, rule by rule as
Pillow's ``JpegImagePlugin`` and ``Image.getexif`` apply them:

- Segments: SOI, then only SOFn (one), DHT, DAC, DQT, DRI, APPn and COM, each complete, each
  starting right where the last one ended (no fill bytes, junk or standalone markers), up to a
  complete SOS. A DQT must hold whole tables, a SOF 8-bit samples, 1, 3 or 4 components and
  whole component records, a JFIF or Adobe segment its fixed fields and an ICC profile chunk its
  sequence numbers, a Photoshop (APP13) resource list no field of which PIL reads past the
  segment unguarded (PIL raises on each otherwise). MPF segments (APP2: PIL may reopen the file as MPO) are left to PIL.
- Size: the SOF's, both sides at least 1 (PIL refuses 0). PIL's bomb check runs only after this
  same parse, so the caller (`packvlm.image_header`) compares it with the pixel limit afterwards
  and still refuses exactly the files the PIL path refuses, with the same numbers.
- Orientation: the one ``Exif\\0\\0`` APP1 segment (several are concatenated by PIL: left to it),
  a plain little- or big-endian TIFF header and IFD0 wholly inside the segment, every out-of-line
  tag value inside it (PIL stops reading the IFD at the first that is not), tag 0x0112 a single
  SHORT (the first stored one wins, as in PIL) and the DPI tags PIL reads while opening of their
  standard types. Without an EXIF orientation, ``tiff:Orientation`` from the last XMP APP1
  segment, with PIL's own pattern; else 1.
- The JPEG plugin must be the first PIL tries on the file, as it is unless a plugin without a
  magic-number check was registered ahead of it.

Example::

    with open("photo.jpg", "rb") as fh:
        header = read_jpeg_header(fh)  # None: ask PIL
    header.stored_width, header.stored_height, header.orientation
"""

from __future__ import annotations

import io
import re
import struct
from typing import IO, NamedTuple

from PIL import Image, JpegImagePlugin, TiffImagePlugin

JPEG_PREFIX = b"\xff\xd8\xff"
_FIRST_READ_BYTES = 4096  # a plain JPEG's tables fit; EXIF with a thumbnail reads more
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_SKIPPED = frozenset({0xC4, 0xCC, 0xDD})  # DHT, DAC, DRI: PIL reads past them
_SOS, _DQT, _COM = 0xDA, 0xDB, 0xFE
_PIL_COMPONENTS = frozenset({1, 3, 4})  # L, RGB, CMYK; PIL refuses other counts
_EXIF_PREFIX = b"Exif\0\0"
_XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"
_PHOTOSHOP_PREFIX = b"Photoshop 3.0\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # Image.getexif's pattern
_TIFF_ENDIAN = {b"II*\0": "<", b"MM\0*": ">"}
_TIFF_UNIT_BYTES = {typ: unit for typ, (unit, _) in TiffImagePlugin.ImageFileDirectory_v2._load_dispatch.items()}
_TIFF_SHORT, _TIFF_RATIONAL = 3, 5
_ORIENTATION_TAG, _RESOLUTION_UNIT_TAG, _X_RESOLUTION_TAG = 0x0112, 0x0128, 0x011A
_EXIF_TAG_TYPES = {_ORIENTATION_TAG: _TIFF_SHORT, _RESOLUTION_UNIT_TAG: _TIFF_SHORT, _X_RESOLUTION_TAG: _TIFF_RATIONAL}


class _Unsure(Exception):
    """The file leaves this parser's vouched-for subset: PIL decides."""


class JpegHeader(NamedTuple):
    """What PIL would report for the file: the SOF's size and the EXIF (or XMP) orientation."""

    stored_width: int
    stored_height: int
    orientation: int


def read_jpeg_header(fh: IO[bytes]) -> JpegHeader | None:
    """The JPEG's stored size and orientation as PIL reads them, or ``None`` to ask PIL."""
    try:
        fh.seek(0)
    except (AttributeError, io.UnsupportedOperation):
        return None  # PIL reads such a stream whole first
    buf = fh.read(_FIRST_READ_BYTES)
    if not buf.startswith(JPEG_PREFIX) or not _jpeg_plugin_opens_first(buf[:16]):
        return None
    try:
        width, height, exif, xmp = _walk_segments(fh, buf)
        orientation = _exif_orientation(exif) if exif is not None else None
    except (_Unsure, struct.error, IndexError):
        return None
    if orientation is None:
        found = _XMP_ORIENTATION.search(xmp) if xmp else None
        orientation = int(found[2]) if found else 1
    return JpegHeader(width, height, orientation)


def _read_to(fh: IO[bytes], buf: bytes, end: int) -> bytes:
    """``buf`` (the file's first bytes) extended to ``end`` bytes; a shorter file is cut there (PIL raises)."""
    while end > len(buf):
        more = fh.read(max(end - len(buf), len(buf)))
        if not more:
            raise _Unsure
        buf += more
    return buf


def _walk_segments(fh: IO[bytes], buf: bytes) -> tuple[int, int, bytes | None, bytes | None]:
    """Width, height, the EXIF segment and the XMP packet, checked as ``JpegImageFile._open`` does."""
    size: tuple[int, int] | None = None
    exif: bytes | None = None
    xmp: bytes | None = None
    pos = 2
    while True:
        if pos + 4 > len(buf):
            buf = _read_to(fh, buf, pos + 4)
        if buf[pos] != 0xFF:
            raise _Unsure  # junk between segments: PIL skips it
        marker = buf[pos + 1]
        start, end = pos + 4, pos + 2 + ((buf[pos + 2] << 8) | buf[pos + 3])
        if end < start:
            raise _Unsure  # a length under 2
        if end > len(buf):
            buf = _read_to(fh, buf, end)
        pos = end
        if marker in _SKIPPED or marker == _COM:
            continue
        if 0xE0 <= marker <= 0xEF:
            if marker == 0xE1 and buf.startswith(_EXIF_PREFIX, start):
                if exif is not None:
                    raise _Unsure  # PIL joins them
                exif = buf[start:end]
            elif marker == 0xE1 and buf.startswith(_XMP_PREFIX, start):
                xmp = buf[start + len(_XMP_PREFIX) : end]
            else:
                _check_app(marker, buf[start:end])
        elif marker == _DQT:
            _check_dqt(buf, start, end)
        elif marker in _SOF:
            if size is not None:
                raise _Unsure
            size = _sof_size(buf[start:end])
        elif marker == _SOS:
            if size is None:
                raise _Unsure  # no mode: PIL refuses
            return size[0], size[1], exif, xmp
        else:
            raise _Unsure


def _check_app(marker: int, body: bytes) -> None:
    """Raise `_Unsure` where PIL's APP handler raises or does more than store the segment."""
    if marker == 0xE0 and body.startswith(b"JFIF") and len(body) < 7:
        raise _Unsure  # its version field is read unguarded
    if marker == 0xE2 and (body.startswith(b"MPF\0") or (body.startswith(b"ICC_PROFILE\0") and len(body) < 14)):
        raise _Unsure
    if marker == 0xED and body.startswith(_PHOTOSHOP_PREFIX):
        _check_photoshop(body)
    if marker == 0xEE and body.startswith(b"Adobe") and len(body) < 7:
        raise _Unsure


def _check_photoshop(body: bytes) -> None:
    """Walk the ``8BIM`` resources as PIL does: it stops quietly where a field is cut (its
    `struct.error`), but a resource cut right after its code makes it raise (`IndexError`)."""
    offset = len(_PHOTOSHOP_PREFIX)
    while body[offset : offset + 4] == b"8BIM":
        offset += 4
        if offset + 2 > len(body):
            return
        code = (body[offset] << 8) | body[offset + 1]
        offset += 2
        if offset >= len(body):
            raise _Unsure
        offset += 1 + body[offset]  # the resource name
        offset += offset & 1
        if offset + 4 > len(body):
            return
        size = struct.unpack_from(">I", body, offset)[0]
        if code == 0x03ED and len(body[offset + 4 : offset + 4 + size]) < 14:
            return  # ResolutionInfo cut: PIL stops there
        offset += 4 + size
        offset += offset & 1


def _sof_size(body: bytes) -> tuple[int, int]:
    if len(body) < 6 or body[0] != 8 or body[5] not in _PIL_COMPONENTS or (len(body) - 6) % 3:
        raise _Unsure
    width, height = (body[3] << 8) | body[4], (body[1] << 8) | body[2]
    if not width or not height:
        raise _Unsure
    return width, height


def _check_dqt(buf: bytes, start: int, end: int) -> None:
    pos = start
    while pos < end:
        pos += 65 if buf[pos] < 16 else 129  # 8- or 16-bit table, after its id byte
    if pos != end:
        raise _Unsure  # PIL: "bad quantization table marker"


def _exif_orientation(segment: bytes) -> int | None:
    """Tag 0x0112 of IFD0 as PIL's ``Exif.load`` stores it; ``None`` when absent."""
    tiff = segment[len(_EXIF_PREFIX) :]
    endian = _TIFF_ENDIAN.get(tiff[:4])
    if endian is None:  # also a second Exif prefix, which PIL strips
        raise _Unsure
    limit = len(tiff)
    (offset,) = struct.unpack_from(endian + "L", tiff, 4)
    if offset < 8 or offset + 2 > limit:
        raise _Unsure
    (num_entries,) = struct.unpack_from(endian + "H", tiff, offset)
    if offset + 2 + 12 * num_entries + 4 > limit:
        raise _Unsure  # PIL keeps the entries before the cut: left to it
    entry = struct.Struct(endian + "HHL4s")
    stored_tags: set[int] = set()  # PIL keeps the first stored entry of a tag
    stored: dict[int, tuple[int, int, bytes]] = {}
    total_bytes = 0
    for index in range(num_entries):
        tag, typ, count, data = entry.unpack_from(tiff, offset + 2 + 12 * index)
        if tag in stored_tags or typ not in _TIFF_UNIT_BYTES:
            continue
        num_bytes = count * _TIFF_UNIT_BYTES[typ]
        if num_bytes > 4:
            (where,) = struct.unpack(endian + "L", data)
            total_bytes += num_bytes
            if total_bytes > limit:
                continue  # PIL skips it
            if where + num_bytes > limit:
                raise _Unsure  # PIL stops reading the IFD here
        if not num_bytes:
            continue  # PIL stores no empty value
        stored_tags.add(tag)
        if tag in _EXIF_TAG_TYPES:
            stored[tag] = typ, count, data
    for tag, (typ, count, _) in stored.items():
        if (typ, count) != (_EXIF_TAG_TYPES[tag], 1):
            raise _Unsure
    if _ORIENTATION_TAG not in stored:
        return None
    return int(struct.unpack_from(endian + "H", stored[_ORIENTATION_TAG][2])[0])


def _jpeg_plugin_opens_first(prefix: bytes) -> bool:
    """Whether ``Image.open`` tries the JPEG plugin before any other on a file starting with ``prefix``."""
    Image.preinit()
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        if fmt == "JPEG":
            return factory is JpegImagePlugin.jpeg_factory
        if accept is None:
            return False
        result = accept(prefix)
        if result and not isinstance(result, str):
            return False
    return False
