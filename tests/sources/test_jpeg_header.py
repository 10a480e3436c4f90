"""`packvlm.jpeg_header`: the pure-Python JPEG header path gives what the PIL path gives, for every input.

The truth is the PIL path itself (`read_image_header` with the fast path switched off, and prep's
`_read_header` on top of it), plus a full decode (``load_image``: decode, then ``exif_transpose``)
where the image decodes. Files are drawn by hypothesis: PIL-written JPEGs of many sizes, modes,
progressive or not, with restart markers, EXIF (orientation 0-9, DPI, strings, a thumbnail IFD,
either byte order), XMP orientation, ICC profiles and comments, then broken on purpose: truncated,
bytes overwritten, garbage after SOI, segments duplicated or added (MPF, Photoshop, fill bytes),
the declared size set to 0 or past the pixel limit. Each file must give the same header or the
same error (type and message; prep: the same reason and message) both ways, and the fast path
must serve the plain files itself (`read_jpeg_header` not ``None``), so a parser that always
handed back to PIL fails here.
"""

from __future__ import annotations

import io
import itertools
import struct
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.image_utils import load_image

from packvlm import image_header
from packvlm.image_header import ImageTooLarge, read_image_header
from packvlm.jpeg_header import read_jpeg_header
from prep.sources.media import LmdbPool, MediaError, _read_header
from prep.sources.media import image_header as file_header
from schemas.media_ref import MediaRef
from tests.sources.test_image_header import CASES as OTHER_FORMATS

SOS = b"\xff\xda"
ICC = b"\0\0\0\x90ADBE\x02\x10\0\0mntrRGB XYZ " + bytes(112)  # any bytes: PIL only splits and joins chunks


def _pil_only() -> Any:
    """The PIL path alone: what `read_image_header` did before the fast path."""
    return mock.patch.object(image_header, "read_jpeg_header", lambda fh: None)


def _header_outcome(data: bytes, max_pixels: int, *, pil: bool) -> tuple[Any, ...]:
    with _pil_only() if pil else nullcontext():
        try:
            return ("ok", read_image_header(io.BytesIO(data), max_pixels))
        except ImageTooLarge as exc:
            return ("too large", str(exc), exc.pixels, exc.size)
        except Image.UnidentifiedImageError:  # its message names the stream object
            return ("unidentified",)
        except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
            return (type(exc).__name__, str(exc))


def _prep_outcome(data: bytes, max_pixels: int, *, pil: bool) -> Any:
    with _pil_only() if pil else nullcontext():
        try:
            return _read_header(io.BytesIO(data), "img.jpg", max_pixels)
        except MediaError as exc:
            return (exc.reason, str(exc))


def _assert_same_both_ways(data: bytes, max_pixels: int = image_header.DECODE_LIMIT_PIXELS) -> None:
    assert _header_outcome(data, max_pixels, pil=False) == _header_outcome(data, max_pixels, pil=True)
    assert _prep_outcome(data, max_pixels, pil=False) == _prep_outcome(data, max_pixels, pil=True)


# ---- files -------------------------------------------------------------------------------------


def _tiff_ifd(endian: str, entries: list[tuple[int, int, int, bytes]], next_ifd: int = 0, base: int = 8) -> bytes:
    """An IFD at ``base`` whose out-of-line values follow it; entries: (tag, type, count, value bytes)."""
    unit = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 7: 1}
    out_of_line = base + 2 + 12 * len(entries) + 4
    table, tail = [], b""
    for tag, typ, count, value in entries:
        if count * unit[typ] > 4:
            table.append(struct.pack(endian + "HHLL", tag, typ, count, out_of_line + len(tail)))
            tail += value
        else:
            table.append(struct.pack(endian + "HHL", tag, typ, count) + value.ljust(4, b"\0"))
    return struct.pack(endian + "H", len(entries)) + b"".join(table) + struct.pack(endian + "L", next_ifd) + tail


def _exif_segment_payload(endian: str, orientation: int | None, *, with_dpi: bool, thumbnail: bytes | None) -> bytes:
    """``Exif\\0\\0`` + a TIFF: IFD0 (Make, orientation, DPI), then IFD1 pointing at a thumbnail JPEG."""
    entries = [(0x010F, 2, 6, b"Maker\0")]
    if orientation is not None:
        entries.append((0x0112, 3, 1, struct.pack(endian + "H", orientation)))
    if with_dpi:
        entries.append((0x011A, 5, 1, struct.pack(endian + "LL", 300, 1)))
        entries.append((0x0128, 3, 1, struct.pack(endian + "H", 2)))
    ifd0 = _tiff_ifd(endian, entries)
    head = (b"II*\0" if endian == "<" else b"MM\0*") + struct.pack(endian + "L", 8)
    if thumbnail is None:
        return b"Exif\0\0" + head + ifd0
    ifd1_at = 8 + len(ifd0)
    ifd0 = _tiff_ifd(endian, entries, next_ifd=ifd1_at)
    thumb_at = ifd1_at + 2 + 12 * 2 + 4
    ifd1 = _tiff_ifd(
        endian,
        [
            (0x0201, 4, 1, struct.pack(endian + "L", thumb_at)),
            (0x0202, 4, 1, struct.pack(endian + "L", len(thumbnail))),
        ],
        base=ifd1_at,
    )
    return b"Exif\0\0" + head + ifd0 + ifd1 + thumbnail


def _segment(marker: int, payload: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload


def _xmp_packet(orientation: int, style: str) -> bytes:
    value = (
        f'tiff:Orientation="{orientation}"'
        if style == "attribute"
        else f"<tiff:Orientation>{orientation}</tiff:Orientation>"
    )
    return (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" {value if style == "attribute" else ""}>'
        f"{value if style != 'attribute' else ''}</rdf:Description></rdf:RDF></x:xmpmeta>"
    ).encode()


def _pil_jpeg(width: int, height: int, mode: str, seed: int, **save: Any) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, "JPEG", **save)
    return buf.getvalue()


@st.composite
def jpegs(draw: st.DrawFn) -> bytes:
    """A JPEG as PIL writes it, with the metadata real files carry, segments spliced in after SOI."""
    width, height = draw(st.integers(1, 96)), draw(st.integers(1, 96))
    save: dict[str, Any] = {"quality": draw(st.sampled_from([50, 90])), "progressive": draw(st.booleans())}
    if draw(st.booleans()):
        save["restart_marker_blocks"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        save["icc_profile"] = ICC
    if draw(st.booleans()):
        save["comment"] = b"a comment"
    if draw(st.booleans()):
        save["dpi"] = (72, 72)
    data = _pil_jpeg(width, height, draw(st.sampled_from(["L", "RGB", "CMYK"])), draw(st.integers(0, 3)), **save)
    extra = b""
    if draw(st.booleans()):
        orientation = draw(st.one_of(st.none(), st.integers(0, 9)))
        thumbnail = _pil_jpeg(8, 8, "RGB", 0) if draw(st.booleans()) else None
        payload = _exif_segment_payload(
            draw(st.sampled_from("<>")), orientation, with_dpi=draw(st.booleans()), thumbnail=thumbnail
        )
        extra += _segment(0xE1, payload)
    for _ in range(draw(st.integers(0, 2))):
        packet = _xmp_packet(draw(st.integers(0, 9)), draw(st.sampled_from(["attribute", "element"])))
        extra += _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + packet)
    if draw(st.booleans()):
        extra += _segment(0xEE, b"Adobe\0d\0\0\0\0\x01")  # what Photoshop writes for YCbCr
    return data[:2] + extra + data[2:]


def _scan_start(data: bytes) -> int:
    return data.index(SOS) + 2


@st.composite
def broken_jpegs(draw: st.DrawFn) -> bytes:
    """A drawn JPEG broken the ways files in the wild are."""
    data = draw(jpegs())
    header_end = _scan_start(data) + 16
    kind = draw(
        st.sampled_from(["truncate", "overwrite", "garbage after SOI", "duplicate segment", "add segment", "size"])
    )
    if kind == "truncate":
        return data[: draw(st.integers(0, header_end))]
    if kind == "overwrite":
        at = draw(st.integers(0, header_end))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    if kind == "garbage after SOI":
        return data[:2] + draw(st.binary(min_size=1, max_size=8)) + data[2:]
    if kind == "duplicate segment":
        at = draw(st.sampled_from([i for i in range(2, _scan_start(data) - 2) if data[i] == 0xFF]))
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        return data[: at + 2 + length] + data[at : at + 2 + length] + data[at + 2 + length :]
    if kind == "add segment":
        added = draw(
            st.sampled_from(
                [
                    _segment(0xE2, b"MPF\0II*\0\x08\0\0\0\0\0\0\0\0\0"),
                    _segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04\0\0\0\0\0\0"),
                    _segment(0xE2, b"ICC_PROFILE\0\x01"),  # a chunk without its count
                    _segment(0xE0, b"JFIF\0"),
                    _segment(0xEE, b"Adobe"),
                    _segment(0xDB, b"\0" * 10),  # a short quantisation table
                    b"\xff\xff\xff",  # fill bytes
                    b"\xff\xd8",  # a second SOI
                    b"\xff\x01",  # TEM, no length
                    _segment(0xC0, b"\x08\0\x10\0\x10\x01\x01\x11\0"),  # a second SOF
                    _segment(0xE1, b"Exif\0\0MM\0*\0\0\0\x08\0\0"),  # a second Exif segment
                    _segment(0xE1, b"Exif\0\0Exif\0\0II*\0\x08\0\0\0\0\0"),
                ]
            )
        )
        at = draw(st.sampled_from([i for i in range(2, _scan_start(data) - 1) if data[i] == 0xFF]))
        return data[:at] + added + data[at:]
    sof = next(i for i in range(2, len(data)) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC2))
    field = draw(st.sampled_from([(5, ">H"), (7, ">H"), (4, ">B"), (9, ">B")]))  # height, width, bits, components
    value = draw(st.sampled_from([0, 1, 2, 12, 16, 60_000, 65_535]))
    if field[1] == ">B":
        value = min(value, 255)
    return data[: sof + field[0]] + struct.pack(field[1], value) + data[sof + field[0] + struct.calcsize(field[1]) :]


def _limits(data: bytes) -> st.SearchStrategy[int]:
    """Pixel limits around the drawn file's size, where the PIL path's two refusals part."""
    try:
        with _pil_only():
            header = read_image_header(io.BytesIO(data))
        pixels = header.stored_width * header.stored_height
    except Exception:  # noqa: BLE001 - unreadable: any limit
        pixels = 100
    return st.sampled_from([image_header.DECODE_LIMIT_PIXELS, pixels, pixels - 1, pixels - 2, pixels + 1, 0, 1])


# ---- tests -------------------------------------------------------------------------------------

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(data=jpegs(), choice=st.data())
def test_a_drawn_jpeg_reads_the_same_both_ways(data: bytes, choice: st.DataObject) -> None:
    _assert_same_both_ways(data, choice.draw(_limits(data)))


@_SETTINGS
@given(data=broken_jpegs(), choice=st.data())
def test_a_broken_jpeg_reads_or_fails_the_same_both_ways(data: bytes, choice: st.DataObject) -> None:
    _assert_same_both_ways(data, choice.draw(_limits(data)))


def _exif_jpeg(orientation: int, endian: str = "<") -> bytes:
    data = _pil_jpeg(30, 20, "RGB", 0)
    payload = _exif_segment_payload(endian, orientation, with_dpi=True, thumbnail=_pil_jpeg(8, 8, "RGB", 1))
    return data[:2] + _segment(0xE1, payload) + data[2:]


def _xmp_jpeg(orientation: int) -> bytes:
    data = _pil_jpeg(30, 20, "RGB", 0)
    return (
        data[:2] + _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + _xmp_packet(orientation, "attribute")) + data[2:]
    )


PLAIN: dict[str, Callable[[int], bytes]] = {
    "baseline, no EXIF": lambda o: _pil_jpeg(30, 20, "RGB", 0),
    "progressive grey": lambda o: _pil_jpeg(30, 20, "L", 0, progressive=True),
    "CMYK, ICC profile": lambda o: _pil_jpeg(30, 20, "CMYK", 0, icc_profile=ICC),
    "restart markers": lambda o: _pil_jpeg(30, 20, "RGB", 0, restart_marker_blocks=1),
    "EXIF by PIL": lambda o: _pil_jpeg(30, 20, "RGB", 0, exif=_pil_exif(o)),
    "EXIF little-endian, DPI, thumbnail": lambda o: _exif_jpeg(o, "<"),
    "EXIF big-endian, DPI, thumbnail": lambda o: _exif_jpeg(o, ">"),
    "XMP only": _xmp_jpeg,
}


def _pil_exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


@pytest.mark.parametrize("case", sorted(PLAIN))
@pytest.mark.parametrize("orientation", range(1, 9))
def test_plain_jpegs_are_served_without_pil_and_equal_a_full_decode(case: str, orientation: int) -> None:
    data = PLAIN[case](orientation)
    fast = read_jpeg_header(io.BytesIO(data))
    assert fast is not None, "the fast path handed a plain JPEG back to PIL"
    truth = load_image(Image.open(io.BytesIO(data))).size  # decodes, then exif_transpose (EXIF, else XMP)
    header = read_image_header(io.BytesIO(data))
    assert (header.width, header.height) == truth
    _assert_same_both_ways(data)
    expected = (
        1 if case in {"baseline, no EXIF", "progressive grey", "CMYK, ICC profile", "restart markers"} else orientation
    )
    assert header.orientation == expected


def test_exif_orientation_wins_over_xmp_and_the_last_xmp_packet_counts() -> None:
    data = _exif_jpeg(6)
    both = data[:2] + _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + _xmp_packet(3, "attribute")) + data[2:]
    assert read_image_header(io.BytesIO(both)).orientation == 6
    xmp = _xmp_jpeg(3)
    two = xmp[:2] + _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + _xmp_packet(8, "element")) + xmp[2:]
    assert read_jpeg_header(io.BytesIO(two)) is not None
    _assert_same_both_ways(two)
    assert read_image_header(io.BytesIO(two)).orientation == 3  # spliced first, so read last


@pytest.mark.parametrize("side", [20_000, 65_535])
def test_a_bomb_is_refused_with_the_pil_paths_numbers(side: int) -> None:
    data = _pil_jpeg(16, 16, "L", 0)
    sof = data.index(b"\xff\xc0")
    bomb = data[: sof + 5] + struct.pack(">HH", side, side) + data[sof + 9 :]
    assert read_jpeg_header(io.BytesIO(bomb)) is not None
    for limit in (image_header.DECODE_LIMIT_PIXELS, side * side - 1, side * side - 2):
        _assert_same_both_ways(bomb, limit)
        with pytest.raises(ImageTooLarge, match=f"{side * side:,} pixels > --max-image-pixels {limit:,}"):
            read_image_header(io.BytesIO(bomb), max_pixels=limit)


def _photoshop_resource(code: int, name: bytes, data: bytes) -> bytes:
    """An ``8BIM`` resource: code, Pascal name padded to even, size, data padded to even."""
    pascal = bytes([len(name)]) + name
    pascal += b"\0" * (len(pascal) & 1)
    return b"8BIM" + struct.pack(">H", code) + pascal + struct.pack(">I", len(data)) + data + b"\0" * (len(data) & 1)


#: what Photoshop writes: ResolutionInfo (72 dpi) and an IPTC record
PHOTOSHOP = _segment(
    0xED,
    b"Photoshop 3.0\0"
    + _photoshop_resource(0x03ED, b"", struct.pack(">IHHIHH", 72 << 16, 1, 1, 72 << 16, 1, 1))
    + _photoshop_resource(0x0404, b"iptc", b"\x1c\x02\x00\x00\x02\x00\x04x"),
)


def _rich_jpeg() -> bytes:
    """Every kind of segment the fast path reads: APP0 JFIF, EXIF (big-endian, DPI, thumbnail), XMP,
    ICC profile, Adobe, COM, DQT, SOF, DHT, DRI, SOS."""
    data = _pil_jpeg(24, 16, "RGB", 0, icc_profile=ICC, comment=b"hi", restart_marker_blocks=2)
    payload = _exif_segment_payload(">", 6, with_dpi=True, thumbnail=b"\xff\xd8\xff\xd9")
    xmp = b"http://ns.adobe.com/xap/1.0/\0" + _xmp_packet(3, "attribute")
    segments = [_segment(0xE1, payload), _segment(0xE1, xmp), _segment(0xEE, b"Adobe\0d\0\0\0\0\x01"), PHOTOSHOP]
    return data[:2] + b"".join(segments) + data[2:]


BASES = {"plain": lambda: _pil_jpeg(16, 16, "RGB", 0), "rich": _rich_jpeg}


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_cut_and_every_changed_header_byte_reads_the_same_both_ways(base: str) -> None:
    """Exhaustive over the header: the file cut at each byte, and each byte set to 0, 0xFF and
    itself + 1 (a length one off, a size of 0, 12-bit samples, a marker that is not one...)."""
    data = BASES[base]()
    assert read_jpeg_header(io.BytesIO(data)) is not None
    header_end = _scan_start(data) + 16
    served = 0
    for at in range(header_end):
        variants = [data[:at]] + [data[:at] + bytes([v]) + data[at + 1 :] for v in {0, 0xFF, (data[at] + 1) % 256}]
        for variant in variants:
            _assert_same_both_ways(variant, 16 * 16 * 2)
            served += read_jpeg_header(io.BytesIO(variant)) is not None
    assert served > header_end  # most changed bytes sit in tables and text, which PIL does not check


def _with_segments(*segments: bytes, base: bytes | None = None) -> bytes:
    data = base if base is not None else _pil_jpeg(24, 16, "RGB", 0)
    return data[:2] + b"".join(segments) + data[2:]


def _exif_with(entries: list[tuple[int, int, int, bytes]], endian: str = "<", tail: bytes = b"") -> bytes:
    head = (b"II*\0" if endian == "<" else b"MM\0*") + struct.pack(endian + "L", 8)
    return _segment(0xE1, b"Exif\0\0" + head + _tiff_ifd(endian, entries) + tail)


def _sof_changed(new_body: Callable[[bytes], bytes]) -> bytes:
    data = _pil_jpeg(24, 16, "RGB", 0)
    at = data.index(b"\xff\xc0")
    (length,) = struct.unpack(">H", data[at + 2 : at + 4])
    return data[:at] + _segment(0xC0, new_body(data[at + 4 : at + 2 + length])) + data[at + 2 + length :]


def _short(value: int, count: int = 1) -> tuple[int, int, int, bytes]:
    return (0x0112, 3, count, struct.pack("<" + "H" * count, *([value] * count)))


_FAR = struct.pack("<L", 10_000)
#: files built to sit on one rule each: (bytes, served by the fast path)
CRAFTED: dict[str, tuple[Callable[[], bytes], bool]] = {
    "SOF with a partial component record": (lambda: _sof_changed(lambda b: b + b"\x04"), False),
    "SOS before SOF": (lambda: _with_segments(_segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")), False),
    "two SOFs": (lambda: _with_segments(_segment(0xC0, b"\x08\0\x10\0\x10\x01\x01\x11\0")), False),
    "two Exif segments": (lambda: _with_segments(_exif_with([_short(6)]), _exif_with([_short(3)])), False),
    "Exif prefix twice": (
        lambda: _with_segments(_segment(0xE1, b"Exif\0\0Exif\0\0II*\0\x08\0\0\0\0\0\0\0\0\0")),
        False,
    ),
    "JFIF cut short": (lambda: _with_segments(_segment(0xE0, b"JFIF\0\1")), False),
    "Adobe cut short": (lambda: _with_segments(_segment(0xEE, b"Adobe\0")), False),
    "ICC chunk without its count": (lambda: _with_segments(_segment(0xE2, b"ICC_PROFILE\0\1")), False),
    "Photoshop resources": (lambda: _with_segments(PHOTOSHOP), True),
    "Photoshop resource cut after its code": (
        lambda: _with_segments(_segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04")),
        False,
    ),
    "Photoshop resource cut in its size": (
        lambda: _with_segments(_segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04\0\0\0")),
        True,
    ),
    "Photoshop ResolutionInfo cut: PIL stops there": (
        lambda: _with_segments(
            _segment(0xED, b"Photoshop 3.0\x00" + _photoshop_resource(0x03ED, b"", b"\0" * 4) + b"8BIM\x04\x04")
        ),
        True,
    ),
    "Photoshop ResolutionInfo cut": (
        lambda: _with_segments(_segment(0xED, b"Photoshop 3.0\x008BIM\x03\xed\0\0\0\0\0\x04\0\0\0\0")),
        True,
    ),
    "MPF": (lambda: _with_segments(_segment(0xE2, b"MPF\0II*\0\x08\0\0\0\0\0\0\0\0\0")), False),
    "fill bytes before a marker": (lambda: _with_segments(b"\xff\xff"), False),
    "DQT with a stray byte": (lambda: _with_segments(_segment(0xDB, bytes(65) + b"\0")), False),
    "16-bit DQT": (lambda: _with_segments(_segment(0xDB, b"\x10" + bytes(range(128)))), True),
    "empty COM and APP5": (lambda: _with_segments(_segment(0xFE, b""), _segment(0xE5, b"")), True),
    "orientation as LONG": (lambda: _with_segments(_exif_with([(0x0112, 4, 1, struct.pack("<L", 6))])), False),
    "orientation as two SHORTs": (lambda: _with_segments(_exif_with([_short(6, 2)])), False),
    "orientation as text": (lambda: _with_segments(_exif_with([(0x0112, 2, 2, b"6\0")])), False),
    "orientation twice: the first counts": (lambda: _with_segments(_exif_with([_short(6), _short(3)])), True),
    "empty orientation, then one": (lambda: _with_segments(_exif_with([_short(6, 0), _short(5)])), True),
    "orientation 0, 9 and 65535": (lambda: _with_segments(_exif_with([_short(65_535)])), True),
    "XResolution as text": (lambda: _with_segments(_exif_with([(0x011A, 2, 2, b"7\0"), _short(6)])), False),
    "ResolutionUnit as LONG": (
        lambda: _with_segments(_exif_with([(0x0128, 4, 1, struct.pack("<L", 2)), _short(6)])),
        False,
    ),
    "a value past the segment ends PIL's IFD": (
        lambda: _with_segments(_exif_with([(0x010F, 2, 8, _FAR), _short(6)], tail=b"")),
        False,
    ),
    "a value larger than the segment is skipped": (
        lambda: _with_segments(_exif_with([(0x010F, 2, 1_000_000, struct.pack("<L", 8)), _short(6)])),
        True,
    ),
    "a repeated tag is not counted twice": (
        lambda: _with_segments(
            _exif_with(
                [
                    (0x010F, 2, 60, struct.pack("<L", 50)),
                    (0x010F, 2, 60, struct.pack("<L", 50)),
                    (0x0112, 3, 3, struct.pack("<L", 110)),
                ],
                tail=bytes(66),
            )
        ),
        False,
    ),
    "IFD0 cut": (lambda: _with_segments(_segment(0xE1, b"Exif\0\0II*\0\x08\0\0\0\x05\0")), False),
    "TIFF magic out of order": (lambda: _with_segments(_segment(0xE1, b"Exif\0\0MM*\0\0\0\0\x08\0\0\0\0\0\0")), False),
    "IFD0 offset inside the header": (
        lambda: _with_segments(_segment(0xE1, b"Exif\0\0II*\0\x04\0\0\0\0\0\0\0")),
        False,
    ),
    "XMP without a digit": (
        lambda: _with_segments(_segment(0xE1, b'http://ns.adobe.com/xap/1.0/\0tiff:Orientation="x"')),
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_file_reads_the_same_both_ways(case: str) -> None:
    build, served = CRAFTED[case]
    data = build()
    assert (read_jpeg_header(io.BytesIO(data)) is not None) == served
    _assert_same_both_ways(data)
    _assert_same_both_ways(data, 24 * 16 - 1)


def test_files_outside_the_vouched_subset_go_to_pil() -> None:
    data = _pil_jpeg(30, 20, "RGB", 0)
    mpf = data[:2] + _segment(0xE2, b"MPF\0II*\0\x08\0\0\0\0\0\0\0\0\0") + data[2:]
    junk = data[:2] + b"\0junk" + data[2:]
    for handed_back in (mpf, junk, data[:-2][: _scan_start(data)], b"\x89PNG\r\n\x1a\n"):
        assert read_jpeg_header(io.BytesIO(handed_back)) is None
        _assert_same_both_ways(handed_back)


def test_a_file_read_unbuffered_gives_what_its_bytes_give_the_pil_path(tmp_path: Path) -> None:
    """prep opens files unbuffered (one read for a JPEG header) and hands PIL a buffered view of
    them: every format, served or handed back, reads as its bytes did through the PIL path."""
    files = {f"{case} {o}": OTHER_FORMATS[case](o) for case in OTHER_FORMATS for o in (1, 6)}
    files |= {case: build() for case, (build, _) in CRAFTED.items()}
    files |= {"cut": _rich_jpeg()[:300], "bomb": _sof_changed(lambda b: b[:1] + b"\xff\xff\xff\xff" + b[5:])}
    for (name, data), limit in itertools.product(
        files.items(), [image_header.DECODE_LIMIT_PIXELS, 30 * 20 - 1, 24 * 16 - 1]
    ):
        path = tmp_path / "image"
        path.write_bytes(data)
        try:
            got: Any = file_header(MediaRef(path=str(path)), LmdbPool(), limit)
        except MediaError as exc:
            got = (exc.reason, str(exc).replace(str(path), "img.jpg"))
        assert got == _prep_outcome(data, limit, pil=True), (name, limit)


class _Pipe(io.RawIOBase):
    """A stream that cannot seek, like a pipe."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._data.readinto(buffer)


def test_a_stream_that_cannot_seek_goes_to_pil() -> None:
    data = _pil_jpeg(24, 16, "RGB", 0)
    assert read_jpeg_header(_Pipe(data)) is None
    assert read_image_header(_Pipe(data)) == read_image_header(io.BytesIO(data))
