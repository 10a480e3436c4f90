"""A video's frame count, fps and size from an MP4/MOV container's ``moov`` box, as PyAV reports them.

`prep.sources.media.video_meta` opened every clip with ``av.open`` (libavformat's mov demuxer plus
``avformat_find_stream_info``, which decodes the first frames): 0.25-0.5 ms per clip, the largest single
cost of counting a video sample. This module walks the boxes itself and answers only when it can
vouch that PyAV gives the same numbers; anything it does not fully follow returns ``None`` and the
caller opens PyAV. What it vouches for, rule by rule as libavformat 62 (``mov.c``) applies them:

- Layout: the file starts with ``ftyp``; top-level boxes are only ``ftyp``, ``free``, ``skip``,
  ``wide``, ``mdat`` (several allowed) and one ``moov``, each wholly inside the file (a truncated
  file goes to PyAV), the ``moov`` before or after the media data. Fragmented files (``mvex``,
  ``moof``), compressed or referenced movies, cover art (``covr`` makes an extra video stream),
  track references (chapters, timecodes) and track-level user data go to PyAV.
- Opening must not fail: libavformat reads every track, so every track's boxes must be whole and
  consistent (sample tables filling their boxes, chunk and sample counts agreeing, data in this
  file), every track a ``vide`` or ``soun`` one (another handler can turn into a video stream
  through its sample entry), audio AAC whose AudioSpecificConfig libavcodec accepts; and PyAV
  decodes every metadata string strictly as UTF-8 (brands, handler names, movie user data: text
  outside ASCII goes to PyAV).
- Stream: ``streams.video[0]`` is then the one ``vide`` track (a second one goes to PyAV).
- Frames: ``stream.frames`` is ``nb_frames``, the sample count summed over ``stts`` (edit lists do
  not change it); every ``stts`` delta must stay below the demuxer's ``max_stts_delta`` (above it
  libavformat rewrites the table); one sample description, at most one edit per track.
- Rate: ``average_rate`` is ``av_reduce(timescale * frames, sum of durations, INT_MAX)`` from
  ``mov_read_header`` (``avformat_find_stream_info`` keeps a rate the demuxer set); answered only
  when the reduced fraction fits ``INT_MAX`` exactly, and when the durations sum to more than 0.
- Size: H.264 (``avc1``): the sample entry's size, which the decoder keeps unless it decodes a
  frame, and then the SPS's cropped size: vouched for when one SPS in ``avcC`` (no scaling
  matrices, cropped only right and bottom) gives the same size. MPEG-4 Part 2 (``mp4v``, object
  type 0x20): libavformat zeroes the size and the decoder sets the VOL header's once a first
  frame's header decodes; vouched for when the configuration is sequence / object / one plain VOL
  (rectangular, progressive, no sprites, 8-bit, H.263 quantisation, no complexity estimation,
  partitioning, newpred or scalability) of the entry's size, no edit moves the start, and the first
  packet is an I-VOP (after an optional GOP header) whose header decodes with at least half a bit
  per macroblock left. Every other codec goes to PyAV.
- Not followed: parameter sets repeated inside later packets (a stream whose in-band SPS or VOL
  differs from its configuration could change the decoder's size while PyAV probes).

Example::

    with open("clip.mp4", "rb") as fh:
        meta = read_mp4_video(fh)  # None: ask PyAV
    meta.num_frames, meta.fps, meta.width, meta.height
"""

from __future__ import annotations

import functools
import io
import math
import os
import struct
from array import array
from collections.abc import Callable
from typing import IO, NamedTuple

_INT_MAX = 2**31 - 1
_MAX_STTS_DELTA = 2**32 - 1 - 48000 * 10  # libavformat's default ``max_stts_delta``
_TOP_LEVEL = frozenset({b"ftyp", b"free", b"skip", b"wide", b"mdat", b"moov"})
_MOOV_CHILDREN = frozenset({b"mvhd", b"trak", b"iods", b"udta", b"free", b"skip"})
_TRAK_CHILDREN = frozenset({b"tkhd", b"mdia", b"edts", b"free", b"skip"})
_MOOV_OTHER_CHILDREN = _MOOV_CHILDREN - {b"trak"}
_EDTS_CHILDREN = frozenset({b"elst"})
_MDIA_CHILDREN = frozenset({b"mdhd", b"hdlr", b"minf"})
_MINF_CHILDREN = frozenset({b"vmhd", b"smhd", b"dinf", b"stbl", b"hdlr"})
_DINF_CHILDREN = frozenset({b"dref"})
_STBL_CHILDREN = frozenset(
    {b"stsd", b"stts", b"stsc", b"stsz", b"stco", b"co64", b"stss", b"ctts", b"sdtp", b"sgpd", b"sbgp"}
)
_ENTRY_CHILDREN = frozenset({b"esds", b"avcC", b"btrt", b"pasp", b"colr", b"uuid"})
_AUDIO_ENTRY_CHILDREN = frozenset({b"esds", b"btrt"})
_VOP_HEAD_BYTES = 64  # of the first MPEG-4 packet: its GOP and VOP headers
_IPOD_UUID = bytes.fromhex("6b6840f25f244fc5ba39a51bcf0323f3")  # the ipod muxer's; libavformat skips it
_AVC_HIGH_PROFILES = frozenset({100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135})
_BOX = struct.Struct(">I4s")  # a box's size and type
_U32 = struct.Struct(">I")
_WORDS_ARE_U32 = array("I").itemsize == 4  # the sample tables are read as arrays of these
_SWAP_WORDS = _WORDS_ARE_U32 and array("I", b"\0\0\0\1")[0] != 1  # a little-endian host


class _Unsure(Exception):
    """The file leaves this parser's vouched-for subset: PyAV decides."""


class Mp4Video(NamedTuple):
    """What PyAV reports for the file's first video stream."""

    num_frames: int  # stream.frames
    fps: float  # float(stream.average_rate)
    width: int
    height: int


def read_mp4_video(fh: IO[bytes] | FileBlocks) -> Mp4Video | None:
    """The first video stream's frame count, fps and size as PyAV reports them, or ``None`` to ask PyAV."""
    try:
        if isinstance(fh, FileBlocks):
            return _read(fh.read_at, fh.size)
        return _read(functools.partial(_seek_read, fh), fh.seek(0, io.SEEK_END))
    except (_Unsure, struct.error, IndexError, KeyError, ValueError):
        return None


class FileBlocks:
    """A regular file's bytes by position, read with ``os.pread`` in blocks and kept: a clip's
    head (``ftyp``, the ``mdat`` header, the first packet) and a ``moov`` at its end cost one
    read each, where seeking a file object reads box by box. ``size`` is the file's (``fstat``)."""

    __slots__ = ("block", "fd", "size", "_blocks")

    def __init__(self, fd: int, size: int, block: int = 8192) -> None:
        self.fd, self.size, self.block = fd, size, block
        self._blocks: list[tuple[int, bytes]] = []

    def read_at(self, pos: int, n: int) -> bytes:
        """What ``seek(pos)`` then ``read(n)`` returns: ``n`` bytes, fewer at the end of the file."""
        if n <= 0:
            return b""
        for start, data in self._blocks:
            if start <= pos and pos + n <= start + len(data):
                return data[pos - start : pos - start + n]
        want = max(n, min(self.block, self.size - pos))  # a block, or up to the end of the file
        data = os.pread(self.fd, want, pos)
        while len(data) < want:  # a short read: the end of the file, or a signal
            more = os.pread(self.fd, want - len(data), pos + len(data))
            if not more:
                break
            data += more
        self._blocks.append((pos, data))
        return data[:n]


def _seek_read(fh: IO[bytes], pos: int, n: int) -> bytes:
    fh.seek(pos)
    return fh.read(n)


def _read(read_at: Callable[[int, int], bytes], file_size: int) -> Mp4Video:
    pos, moov = 0, None
    while pos < file_size:
        head = read_at(pos, 16)
        if len(head) < 8:
            raise _Unsure
        size, kind = _BOX.unpack_from(head)
        header = 8
        if size == 1:
            if len(head) < 16:
                raise _Unsure
            size, header = struct.unpack_from(">Q", head, 8)[0], 16
        if kind not in _TOP_LEVEL or size < header or pos + size > file_size or (pos == 0) != (kind == b"ftyp"):
            raise _Unsure
        if kind == b"ftyp":
            _check_ftyp((head[header:] + read_at(pos + 16, max(0, size - 16)))[: size - header])
        elif kind == b"moov":
            if moov is not None:
                raise _Unsure
            moov = (head[header:] + read_at(pos + 16, max(0, size - 16)))[: size - header]
            if len(moov) != size - header:
                raise _Unsure
        pos += size
    if moov is None or b"covr" in moov:
        raise _Unsure
    video, vol = _video_track(moov)
    if vol is not None:  # MPEG-4 Part 2: the size is the decoder's, set once a first frame's header decodes
        offset, size = vol.first_sample
        if offset + size > file_size:
            raise _Unsure
        _check_first_vop(read_at(offset, min(size, _VOP_HEAD_BYTES)), size, vol, video.width, video.height)
    return video


def _utf8(text: bytes) -> None:
    """PyAV decodes every metadata string strictly as UTF-8 while opening (a bad one raises)."""
    try:
        text.split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Unsure from exc


def _check_ftyp(ftyp: bytes) -> None:
    if len(ftyp) < 8 or ftyp[:4] == b"aaxc":  # Audible's encrypted files
        raise _Unsure
    _utf8(ftyp[:4])  # major_brand
    _utf8(ftyp[8:])  # compatible_brands


def _check_hdlr(hdlr: bytes) -> bytes:
    """The handler type; its name (``handler_name``, maybe a Pascal string) must decode."""
    if len(hdlr) < 24:
        raise _Unsure
    _utf8(hdlr[24:])
    _utf8(hdlr[25:])
    return hdlr[8:12]


def _check_udta(udta: bytes) -> None:
    """Movie user data (``encoder`` and the like): only text libavformat and PyAV read as ASCII."""
    for kind, payload in _box_list(udta):
        if kind == b"meta":
            if payload[:4] != b"\0\0\0\0":
                raise _Unsure
            for child, body in _box_list(payload[4:]):
                if child == b"ilst":
                    for _, item in _box_list(body):
                        for _, data in _box_list(item):
                            _ascii(data)
                elif child != b"hdlr":  # a movie-level meta handler is not read
                    _ascii(body)
        elif kind[:1] == b"\xa9":  # QuickTime text: size, language code, then the string
            _ascii(payload[4:])
        else:
            raise _Unsure


def _ascii(data: bytes) -> None:
    if not data.isascii():
        raise _Unsure


def _box_list(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos, end = [], 0, len(data)
    while pos < end:
        size, kind = _BOX.unpack_from(data, pos)
        if size < 8 or pos + size > end:
            raise _Unsure
        out.append((kind, data[pos + 8 : pos + size]))
        pos += size
    return out


def _boxes(data: bytes, allowed: frozenset[bytes]) -> dict[bytes, bytes]:
    """A box's children by type: each once, each of an allowed type, filling ``data`` exactly."""
    out: dict[bytes, bytes] = {}
    pos, end = 0, len(data)
    unpack = _BOX.unpack_from
    while pos < end:
        size, kind = unpack(data, pos)
        after = pos + size
        if size < 8 or after > end or kind not in allowed or kind in out:
            raise _Unsure
        out[kind] = data[pos + 8 : after]
        pos = after
    return out


def _traks(moov: bytes) -> list[bytes]:
    """The ``trak`` payloads in file order (the only repeated child of ``moov``)."""
    traks, rest, pos = [], bytearray(), 0
    end = len(moov)
    while pos < end:
        size, kind = _BOX.unpack_from(moov, pos)
        if size < 8 or pos + size > end:
            raise _Unsure
        if kind == b"trak":
            traks.append(moov[pos + 8 : pos + size])
        else:
            rest += moov[pos : pos + size]
        pos += size
    others = _boxes(bytes(rest), _MOOV_OTHER_CHILDREN)  # the other children: known, once each
    if b"udta" in others:
        _check_udta(others[b"udta"])
    return traks


class _Track(NamedTuple):
    handler: bytes
    timescale: int
    num_frames: int  # summed over stts
    duration: int  # summed over stts
    stsd: bytes
    first_sample: tuple[int, int]  # file offset and size
    edit_start: int  # the one edit's media time, else 0


def _track(trak: bytes) -> _Track:
    """A track's handler and timing; every box libavformat reads here whole and consistent."""
    boxes = _boxes(trak, _TRAK_CHILDREN)
    tkhd = boxes[b"tkhd"]
    if len(tkhd) != (96 if _full_box(tkhd, (0, 1)) else 84):
        raise _Unsure
    edit_start = _one_edit(boxes[b"edts"]) if b"edts" in boxes else 0
    mdia = _boxes(boxes[b"mdia"], _MDIA_CHILDREN)
    timescale = _timescale(mdia[b"mdhd"])
    handler = _check_hdlr(mdia[b"hdlr"])
    minf = _boxes(mdia[b"minf"], _MINF_CHILDREN)
    if b"hdlr" in minf and _check_hdlr(minf[b"hdlr"]) not in (b"alis", b"url ", b"rsrc"):
        raise _Unsure  # a data handler; a media one retypes the stream
    if b"dinf" in minf:
        _check_dref(_boxes(minf[b"dinf"], _DINF_CHILDREN)[b"dref"])
    stbl = _boxes(minf[b"stbl"], _STBL_CHILDREN)
    num_frames, duration = _stts(stbl[b"stts"])
    chunks, first_chunk = _chunks(stbl)
    sample_count, first_size = _stsz(stbl[b"stsz"])
    if num_frames < 1 or duration < 1 or chunks < 1 or sample_count != num_frames:
        raise _Unsure
    _check_stsc(stbl[b"stsc"], chunks)
    if b"stss" in stbl and not _table(stbl[b"stss"], 1):
        raise _Unsure  # no sync samples: libavformat parses the stream
    if b"ctts" in stbl:
        _table(stbl[b"ctts"], 2)
    return _Track(handler, timescale, num_frames, duration, stbl[b"stsd"], (first_chunk, first_size), edit_start)


def _check_dref(dref: bytes) -> None:
    """Data references all in this file: ``url `` or ``alis`` entries with only their flags."""
    _full_box(dref)
    entries = _box_list(dref[8:])
    if not entries or _U32.unpack_from(dref, 4)[0] != len(entries):
        raise _Unsure
    if any(kind not in (b"url ", b"alis") or payload != b"\0\0\0\1" for kind, payload in entries):
        raise _Unsure


def _video_track(moov: bytes) -> tuple[Mp4Video, _Vol | None]:
    tracks = [_track(trak) for trak in _traks(moov)]
    kinds = [track.handler for track in tracks]
    if kinds.count(b"vide") != 1 or any(kind not in (b"vide", b"soun") for kind in kinds):
        raise _Unsure
    for track in tracks:
        if track.handler == b"soun":
            _check_aac(track.stsd)
    video = tracks[kinds.index(b"vide")]
    width, height, vol = _frame_size(video.stsd)
    if vol is not None:
        if video.edit_start:  # the first packet decoded is then another one
            raise _Unsure
        vol = _Vol(vol.width, vol.height, vol.time_increment_bits, video.first_sample)
    common = math.gcd(video.timescale * video.num_frames, video.duration)
    num, den = video.timescale * video.num_frames // common, video.duration // common
    if num > _INT_MAX or den > _INT_MAX:
        raise _Unsure  # av_reduce approximates: not followed here
    # float(Fraction) and av_q2d both divide exactly representable integers: the same double
    return Mp4Video(num_frames=video.num_frames, fps=num / den, width=width, height=height), vol


def _sample_entry(stsd: bytes) -> tuple[bytes, bytes]:
    """The one sample description's fourcc and body."""
    _full_box(stsd)
    if _U32.unpack_from(stsd, 4)[0] != 1:
        raise _Unsure
    size, fourcc = _BOX.unpack_from(stsd, 8)
    if len(stsd) != 8 + size:
        raise _Unsure
    return fourcc, stsd[16 : 8 + size]


def _check_aac(stsd: bytes) -> None:
    """An audio track libavformat opens without error: AAC (``mp4a``, object type 0x40) whose
    AudioSpecificConfig ``avpriv_mpeg4audio_get_config2`` accepts (plain AAC object types)."""
    fourcc, entry = _sample_entry(stsd)
    if fourcc != b"mp4a" or len(entry) < 28 or entry[8:10] != b"\0\0":  # version 0 sound description
        raise _Unsure
    children = _boxes(entry[28:], _AUDIO_ENTRY_CHILDREN)
    config = _decoder_config(children[b"esds"], 0x40)
    if len(config) < 2:
        raise _Unsure
    object_type, rate_index, channels = config[0] >> 3, (config[0] & 7) << 1 | config[1] >> 7, config[1] >> 3 & 15
    if object_type not in (1, 2, 3, 4) or rate_index == 15 or channels >= 15:
        raise _Unsure


def _full_box(payload: bytes, versions: tuple[int, ...] = (0,)) -> int:
    if len(payload) < 4 or payload[0] not in versions:
        raise _Unsure
    return payload[0]


def _one_edit(edts: bytes) -> int:
    elst = _boxes(edts, _EDTS_CHILDREN)[b"elst"]
    version = _full_box(elst, (0, 1))
    entry = 20 if version == 1 else 12
    if _U32.unpack_from(elst, 4)[0] != 1 or len(elst) != 8 + entry:
        raise _Unsure
    media_time: int = struct.unpack_from(">q" if version == 1 else ">i", elst, 16 if version == 1 else 12)[0]
    return media_time


def _timescale(mdhd: bytes) -> int:
    version = _full_box(mdhd, (0, 1))
    offset = 20 if version == 1 else 12
    if len(mdhd) < offset + (12 if version == 1 else 8):
        raise _Unsure
    timescale: int = _U32.unpack_from(mdhd, offset)[0]
    if not 0 < timescale <= _INT_MAX:
        raise _Unsure
    return timescale


def _table(payload: bytes, entry_words: int) -> array[int]:
    """A full box's count-prefixed table of big-endian 32-bit words, which must fill the box."""
    _full_box(payload)
    count = _U32.unpack_from(payload, 4)[0]
    if len(payload) != 8 + 4 * entry_words * count:
        raise _Unsure
    if not _WORDS_ARE_U32:
        raise _Unsure
    words = array("I", payload[8:])
    if _SWAP_WORDS:
        words.byteswap()
    return words


def _stts(stts: bytes) -> tuple[int, int]:
    """The sample count and the summed durations."""
    words = _table(stts, 2)
    if len(words) <= 32:
        counts, deltas = words[0::2], words[1::2]
        if deltas and max(deltas) > _MAX_STTS_DELTA:
            raise _Unsure
        return sum(counts), sum(c * d for c, d in zip(counts, deltas, strict=True))
    # variable frame durations: thousands of entries, summed in numpy where int64 cannot overflow
    import numpy as np  # deferred: only such files need it

    table = np.frombuffer(stts, ">u4", offset=8).reshape(-1, 2).astype(np.uint64)
    counts_max, deltas_max = (int(v) for v in table.max(axis=0))
    if deltas_max > _MAX_STTS_DELTA or counts_max * deltas_max * len(table) >= 2**63:
        raise _Unsure
    return int(table[:, 0].sum()), int((table[:, 0] * table[:, 1]).sum())


def _stsz(stsz: bytes) -> tuple[int, int]:
    """The sample count and the first sample's size."""
    _full_box(stsz)
    if len(stsz) < 12:
        raise _Unsure
    sample_size, count = struct.unpack_from(">II", stsz, 4)
    if len(stsz) != 12 + (0 if sample_size else 4 * count):
        raise _Unsure
    first = sample_size or (_U32.unpack_from(stsz, 12)[0] if count else 0)
    return int(count), int(first)


def _chunks(stbl: dict[bytes, bytes]) -> tuple[int, int]:
    """The chunk count and the first chunk's file offset."""
    if (b"stco" in stbl) == (b"co64" in stbl):
        raise _Unsure
    if b"stco" in stbl:
        offsets = _table(stbl[b"stco"], 1)
        return len(offsets), offsets[0] if offsets else 0
    words = _table(stbl[b"co64"], 2)
    return len(words) // 2, (words[0] << 32 | words[1]) if words else 0


def _check_stsc(stsc: bytes, chunks: int) -> None:
    words = _table(stsc, 3)
    if not words or words[0] != 1 or words[-3] > chunks or words[2::3].count(1) != len(words) // 3:
        raise _Unsure  # one sample description, the last run inside the chunk table


def _frame_size(stsd: bytes) -> tuple[int, int, _Vol | None]:
    fourcc, entry = _sample_entry(stsd)
    if len(entry) < 78:
        raise _Unsure
    width, height = struct.unpack_from(">HH", entry, 24)
    depth, color_table = struct.unpack_from(">Hh", entry, 74)
    if depth != 24 or color_table != -1 or width < 1 or height < 1:
        raise _Unsure
    children = _boxes(entry[78:], _ENTRY_CHILDREN)
    if children.get(b"uuid", _IPOD_UUID)[:16] != _IPOD_UUID:
        raise _Unsure
    vol = None
    if fourcc == b"avc1" and b"avcC" in children and b"esds" not in children:
        coded = _avc_size(children[b"avcC"])
    elif fourcc == b"mp4v" and b"esds" in children and b"avcC" not in children:
        vol = _parse_vol(_decoder_config(children[b"esds"], 0x20))
        coded = vol.width, vol.height
    else:
        raise _Unsure
    if coded != (width, height):
        raise _Unsure
    return width, height, vol


class _Bits:
    """An MSB-first bit reader over ``data`` (a NAL payload or a start-code-delimited header)."""

    def __init__(self, data: bytes) -> None:
        self.value, self.left = int.from_bytes(data, "big"), 8 * len(data)

    def u(self, n: int) -> int:
        if n > self.left:
            raise _Unsure
        self.left -= n
        return (self.value >> self.left) & ((1 << n) - 1)

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise _Unsure
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k % 2 else -(k // 2)


@functools.lru_cache(maxsize=256)  # a pure function of bytes many clips share
def _avc_size(avcc: bytes) -> tuple[int, int]:
    """The cropped frame size of the one SPS in an ``avcC`` record (H.264 7.3.2.1.1)."""
    if len(avcc) < 8 or avcc[0] != 1 or avcc[5] & 0x1F != 1:
        raise _Unsure
    nal_size = struct.unpack_from(">H", avcc, 6)[0]
    nal = avcc[8 : 8 + nal_size]
    if len(nal) != nal_size or nal_size < 4 or nal[0] & 0x1F != 7:
        raise _Unsure
    rbsp = nal[1:].replace(b"\0\0\3", b"\0\0")
    bits = _Bits(rbsp)
    profile = bits.u(8)
    bits.u(16)  # constraint flags, level
    bits.ue()  # seq_parameter_set_id
    chroma = 1
    if profile in _AVC_HIGH_PROFILES:
        chroma = bits.ue()
        if chroma > 3:
            raise _Unsure
        if chroma == 3:
            bits.u(1)  # separate_colour_plane_flag
        if bits.ue() > 6 or bits.ue() > 6:  # bit depths
            raise _Unsure
        bits.u(1)  # qpprime_y_zero_transform_bypass_flag
        if bits.u(1):  # scaling matrices: not followed
            raise _Unsure
    bits.ue()  # log2_max_frame_num_minus4
    poc_type = bits.ue()
    if poc_type == 0:
        bits.ue()
    elif poc_type == 1:
        bits.u(1)
        bits.se()
        bits.se()
        for _ in range(bits.ue()):
            bits.se()
    elif poc_type != 2:
        raise _Unsure
    bits.ue()  # max_num_ref_frames
    bits.u(1)  # gaps_in_frame_num_value_allowed_flag
    mbs_wide, map_units_high = bits.ue() + 1, bits.ue() + 1
    frame_mbs_only = bits.u(1)
    if not frame_mbs_only:
        bits.u(1)  # mb_adaptive_frame_field_flag
    bits.u(1)  # direct_8x8_inference_flag
    width, height = 16 * mbs_wide, 16 * map_units_high * (2 - frame_mbs_only)
    if bits.u(1):  # frame_cropping_flag
        left, right, top, bottom = bits.ue(), bits.ue(), bits.ue(), bits.ue()
        step_x = 2 if chroma in (1, 2) else 1
        step_y = (2 - frame_mbs_only) * (2 if chroma == 1 else 1)
        if left or top or right * step_x >= 16 or bottom * step_y >= 16:
            raise _Unsure  # libavcodec realigns left/top crops and drops oversized ones
        width, height = width - right * step_x, height - bottom * step_y
    return width, height


def _descriptor(data: bytes, pos: int, tag: int) -> tuple[int, int]:
    """Start and end of the MPEG-4 descriptor with ``tag`` at ``pos`` (ISO 14496-1 expandable size)."""
    if data[pos] != tag:
        raise _Unsure
    length, pos = 0, pos + 1
    for _ in range(4):
        byte = data[pos]
        pos += 1
        length = (length << 7) | (byte & 0x7F)
        if not byte & 0x80:
            break
    else:
        raise _Unsure
    if pos + length > len(data):
        raise _Unsure
    return pos, pos + length


def _decoder_config(esds: bytes, object_type: int) -> bytes:
    """The decoder-specific info of an ``esds`` box whose object type is ``object_type``."""
    _full_box(esds)
    start, end = _descriptor(esds, 4, 0x03)
    flags = esds[start + 2]
    pos = start + 3 + (2 if flags & 0x80 else 0)
    if flags & 0x40:
        pos += 1 + esds[pos]
    pos += 2 if flags & 0x20 else 0
    start, end = _descriptor(esds, pos, 0x04)
    if esds[start] != object_type:
        raise _Unsure
    start, end = _descriptor(esds, start + 13, 0x05)
    return esds[start:end]


class _Vol(NamedTuple):
    """What the MPEG-4 decoder keeps from the configuration's VOL header."""

    width: int
    height: int
    time_increment_bits: int
    first_sample: tuple[int, int] = (0, 0)  # file offset and size of the first packet


def _start_codes(data: bytes) -> list[int]:
    out, pos = [], data.find(b"\0\0\1")
    while 0 <= pos < len(data) - 3:
        out.append(pos)
        pos = data.find(b"\0\0\1", pos + 3)
    return out


@functools.lru_cache(maxsize=256)  # a pure function of bytes many clips share
def _parse_vol(config: bytes) -> _Vol:
    """The decoder's reading of its configuration (``ff_mpeg4_parse_picture_header`` at init):
    sequence, object and user-data headers around one video object layer (ISO 14496-2 6.2.3)
    of the plain kind libavcodec's encoder writes (rectangular, progressive, no sprites, 8-bit,
    H.263 quantisation, no complexity estimation, data partitioning, newpred or scalability)."""
    starts = _start_codes(config)
    if not starts or starts[0] != 0:
        raise _Unsure
    codes = [config[i + 3] for i in starts]
    vols = [n for n, code in enumerate(codes) if 0x20 <= code <= 0x2F]
    if len(vols) != 1 or any(code not in (0xB0, 0xB2, 0xB5) and code > 0x2F for code in codes):
        raise _Unsure  # no VOP, GOP or other headers: the init parse would stop or go elsewhere
    for n, code in enumerate(codes):
        body = config[starts[n] + 4 : starts[n + 1] if n + 1 < len(starts) else len(config)]
        if code == 0xB0 and (not body or body[0] >> 4 == 0xF):  # studio profiles
            raise _Unsure
        if code == 0xB2 and b"DivX" in body:  # packed bitstreams
            raise _Unsure
    end = starts[vols[0] + 1] if vols[0] + 1 < len(starts) else len(config)
    bits = _Bits(config[starts[vols[0]] + 4 : end])
    bits.u(1)  # random_accessible_vol
    if bits.u(8) in (14, 15):  # video_object_type_indication: studio
        raise _Unsure
    verid = 1
    if bits.u(1):  # is_object_layer_identifier
        verid = bits.u(4)
        bits.u(3)
    if bits.u(4) == 15:  # extended aspect ratio
        bits.u(16)
    if bits.u(1):  # vol_control_parameters
        bits.u(3)  # chroma_format (only logged), low_delay
        if bits.u(1):  # vbv parameters
            bits.u(79)
    if bits.u(2) != 0:  # rectangular shape only
        raise _Unsure
    bits.u(1)  # marker
    resolution = bits.u(16)
    if not resolution:
        raise _Unsure
    time_increment_bits = max(1, (resolution - 1).bit_length())  # av_log2(resolution - 1) + 1
    bits.u(1)  # marker
    if bits.u(1):  # fixed_vop_rate
        bits.u(time_increment_bits)
    bits.u(1)  # marker
    width = bits.u(13)
    bits.u(1)  # marker
    height = bits.u(13)
    bits.u(1)  # marker
    if bits.u(1):  # interlaced
        raise _Unsure
    bits.u(1)  # obmc_disable
    if bits.u(1 if verid == 1 else 2):  # sprite_enable
        raise _Unsure
    if bits.u(1) or bits.u(1):  # not_8_bit, quant_type
        raise _Unsure
    if verid != 1:
        bits.u(1)  # quarter_sample
    if not bits.u(1):  # complexity_estimation_disable
        raise _Unsure
    bits.u(1)  # resync_marker_disable
    if bits.u(1):  # data_partitioned
        raise _Unsure
    if verid != 1 and (bits.u(1) or bits.u(1)):  # newpred, reduced_resolution_vop
        raise _Unsure
    if bits.u(1):  # scalability
        raise _Unsure
    if not width or not height or (width + 128) * (height + 128) >= _INT_MAX // 8:
        raise _Unsure  # av_image_check_size
    return _Vol(width, height, time_increment_bits)


def _check_first_vop(sample: bytes, size: int, vol: _Vol, width: int, height: int) -> None:
    """The first packet is an I-VOP whose header ``decode_vop_header`` reads without error and
    leaves the bits ``ff_h263_decode_frame`` asks for: then the decoder takes the VOL's size.
    ``sample`` is the packet's head, ``size`` its whole length."""
    vop = 0
    if sample.startswith(b"\0\0\1\xb3"):  # a GOP header (20 bits), then the scan for the next start code
        vop = sample.find(b"\0\0\1", 7)
    if vop < 0 or sample[vop : vop + 4] != b"\0\0\1\xb6":
        raise _Unsure
    bits = _Bits(sample[vop + 4 :])
    if bits.u(2) != 0:  # vop_coding_type: I
        raise _Unsure
    for _ in range(64):  # modulo_time_base
        if not bits.u(1):
            break
    else:
        raise _Unsure
    bits.u(1)  # marker
    bits.u(vol.time_increment_bits)  # vop_time_increment
    if not bits.u(1) or not bits.u(1):  # marker (libavcodec guesses the field width without it), vop_coded
        raise _Unsure
    bits.u(3)  # intra_dc_vlc_thr
    if not bits.u(5):  # vop_quant
        raise _Unsure
    macroblocks = ((width + 15) // 16) * ((height + 15) // 16)
    if macroblocks // 2 > bits.left + 8 * (size - len(sample)):  # the bits left in the whole packet
        raise _Unsure
