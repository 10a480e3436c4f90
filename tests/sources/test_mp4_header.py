"""`packvlm.mp4_header`: reading an MP4/MOV's ``moov`` gives what the PyAV path gives, for every input.

The truth is `prep.sources.media.video_meta` with the header parser switched off (``av.open``, the
first video stream's ``frames``, ``average_rate``, ``width``, ``height``, or the error it raises).
Clips are written with PyAV here: MPEG-4 Part 2 and H.264 (and MJPEG, which goes to PyAV) in the
mp4, mov and ipod (.m4v) muxers, constant rates from 1 to 60 fps including 30000/1001, 12000/1001
and 7.5, variable frame durations, one frame to a few hundred, sizes not multiples of 16, ``moov``
before or after the media data, an audio track ahead of the video, two video tracks, fragmented
files, other containers. Plain files must be served by the parser itself (so a parser that always
hands back to PyAV fails here); every single-byte change of a ``moov``, every cut of a file and
random multi-byte edits must give the PyAV path's answer: the same metadata or the same error.
"""

from __future__ import annotations

import functools
import io
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any
from unittest import mock

import av
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packvlm.mp4_header import read_mp4_video
from prep.example.media import write_video
from prep.sources import media
from prep.sources.media import MediaError
from schemas.media_ref import MediaRef

FORMATS = {"mp4": "mp4", "mov": "mov", "m4v": "ipod"}
SERVED_CODECS = ("mpeg4", "libx264")


def _clip(
    fmt: str = "mp4",
    codec: str = "mpeg4",
    rate: Fraction | int = 25,
    frames: int = 3,
    size: tuple[int, int] = (16, 16),
    *,
    options: dict[str, str] | None = None,
    pts: list[int] | None = None,
    time_base: Fraction | None = None,
    audio_first: bool = False,
    second_video: bool = False,
) -> bytes:
    """A clip written by PyAV (through a file: faststart rewrites it)."""
    width, height = size
    pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    scratch = tempfile.TemporaryDirectory()
    path = Path(scratch.name) / "clip"
    with scratch, av.open(str(path), "w", format=FORMATS.get(fmt, fmt), options=options or {}) as container:
        audio = container.add_stream("aac", rate=8000) if audio_first else None
        streams: list[av.VideoStream] = []
        for _ in range(2 if second_video else 1):
            stream = container.add_stream(codec, rate=rate)
            assert isinstance(stream, av.VideoStream)
            streams.append(stream)
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            stream.codec_context.time_base = time_base or 1 / Fraction(rate)
            stream.codec_context.thread_count = 1
        if audio is not None:
            assert isinstance(audio, av.AudioStream)
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 8000, 0
            for packet in [*audio.encode(samples), *audio.encode()]:
                container.mux(packet)
        for index in range(frames):
            pixels = np.full((height, width, 3), (index * 37) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format=pix_fmt)
            for stream in streams:
                frame.pts, frame.time_base = (pts[index] if pts else index), stream.codec_context.time_base
                for packet in stream.encode(frame):
                    container.mux(packet)
        for stream in streams:
            for packet in stream.encode():
                container.mux(packet)
        container.close()
        return path.read_bytes()


def _outcome(path: Path) -> Any:
    """``video_meta``'s answer for the file: its metadata, or the reason and message of its error."""
    try:
        return media.video_meta(MediaRef(path=str(path)))
    except MediaError as exc:
        return (exc.reason, str(exc))


def _pyav_outcome(path: Path) -> Any:
    with mock.patch.object(media, "read_mp4_video", return_value=None):
        return _outcome(path)


def _assert_same_both_ways(data: bytes, path: Path) -> bool:
    """The parser either hands back to PyAV or answers exactly what the PyAV path answers."""
    header = read_mp4_video(io.BytesIO(data))
    if header is None:
        return False
    path.write_bytes(data)
    truth = _pyav_outcome(path)
    assert not isinstance(truth, tuple), f"PyAV refuses the file ({truth}), the parser answered {header}"
    assert tuple(header) == (truth.num_frames, truth.fps, truth.width, truth.height)
    return True


def _assert_served_and_equal(data: bytes, path: Path) -> None:
    assert read_mp4_video(io.BytesIO(data)) is not None, "a plain file must be read without PyAV"
    assert _assert_same_both_ways(data, path)
    assert _outcome(path) == _pyav_outcome(path)  # and video_meta itself serves it


RATES = [24, 25, 30, Fraction(30000, 1001), 60, 1, Fraction(15, 2), Fraction(12000, 1001)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("codec", SERVED_CODECS)
@pytest.mark.parametrize("rate", RATES, ids=str)
def test_plain_clips_are_served_and_equal_pyav(fmt: str, codec: str, rate: Fraction, tmp_path: Path) -> None:
    frames, size = {1: (1, (16, 16)), 60: (70, (18, 34))}.get(int(rate), (5, (50, 22)))
    _assert_served_and_equal(_clip(fmt, codec, rate, frames, size), tmp_path / f"clip.{fmt}")


@pytest.mark.parametrize("codec", SERVED_CODECS)
@pytest.mark.parametrize("size", [(2, 2), (30, 14), (66, 38), (640, 360), (854, 480)])
def test_sizes_that_are_not_multiples_of_16_are_the_decoders(codec: str, size: tuple[int, int], tmp_path: Path) -> None:
    _assert_served_and_equal(_clip("mp4", codec, 25, 2, size), tmp_path / "clip.mp4")


@pytest.mark.parametrize("codec", SERVED_CODECS)
@pytest.mark.parametrize("movflags", ["faststart", "+faststart+disable_chpl", ""])
def test_moov_before_or_after_the_media_data(codec: str, movflags: str, tmp_path: Path) -> None:
    data = _clip(
        "mp4", codec, Fraction(30000, 1001), 40, (32, 24), options={"movflags": movflags} if movflags else None
    )
    assert (data.find(b"moov") < data.find(b"mdat")) == ("faststart" in movflags)
    _assert_served_and_equal(data, tmp_path / "clip.mp4")


@pytest.mark.parametrize("codec", SERVED_CODECS)
@pytest.mark.parametrize(
    "pts",
    [
        [0, 1, 3, 4, 9, 10, 30],
        [0, 40, 80, 1000, 1001, 1002, 1003],
        [0, 33, 67, 100, 133, 167, 1167],
        [sum(1 + i % 3 + i % 5 for i in range(k)) * 10 for k in range(60)],  # ~50 stts entries
    ],
    ids=["short", "pause", "ntsc_then_gap", "jitter60"],
)
def test_variable_frame_durations(codec: str, pts: list[int], tmp_path: Path) -> None:
    data = _clip("mp4", codec, 30, len(pts), (16, 16), pts=pts, time_base=Fraction(1, 1000))
    _assert_served_and_equal(data, tmp_path / "clip.mp4")


def test_a_long_clip(tmp_path: Path) -> None:
    _assert_served_and_equal(_clip("mp4", "mpeg4", 30, 400, (16, 16)), tmp_path / "clip.mp4")


@pytest.mark.parametrize("codec", SERVED_CODECS)
def test_an_audio_track_ahead_of_the_video(codec: str, tmp_path: Path) -> None:
    data = _clip("mp4", codec, 25, 4, (16, 16), audio_first=True)
    assert data.count(b"trak") == 2
    _assert_served_and_equal(data, tmp_path / "clip.mp4")


def test_the_bench_clips_are_served(tmp_path: Path) -> None:
    """`prep.example.media.write_video` (what the benchmarks and examples write)."""
    write_video(tmp_path / "clip.mp4", 45, 30000 / 1001, 854, 480)
    _assert_served_and_equal((tmp_path / "clip.mp4").read_bytes(), tmp_path / "copy.mp4")


@pytest.mark.parametrize(
    "case",
    [
        "mjpeg",
        "two_video_tracks",
        "fragmented",
        "fragmented_empty_moov",
        "mkv",
        "avi",
    ],
)
def test_files_outside_the_vouched_subset_go_to_pyav(case: str, tmp_path: Path) -> None:
    if case in ("mkv", "avi"):
        data = write_video(tmp_path / f"clip.{case}", 4, 25, 16, 16).read_bytes()
    else:
        data = {
            "mjpeg": lambda: _clip("mov", "mjpeg"),
            "two_video_tracks": lambda: _clip(second_video=True),
            "fragmented": lambda: _clip(options={"movflags": "frag_keyframe"}),
            "fragmented_empty_moov": lambda: _clip(options={"movflags": "frag_keyframe+empty_moov"}),
        }[case]()
    assert read_mp4_video(io.BytesIO(data)) is None
    path = tmp_path / "other"
    path.write_bytes(data)
    assert not isinstance(_outcome(path), tuple)  # PyAV reads them: the path stays open


def _moov_span(data: bytes) -> range:
    start = data.find(b"moov") - 4
    return range(start, start + int.from_bytes(data[start : start + 4], "big"))


BASES = {
    "mpeg4_moov_last": lambda: _clip("mp4", "mpeg4", Fraction(30000, 1001), 3, (18, 14)),
    "mpeg4_faststart": lambda: _clip("mp4", "mpeg4", 25, 3, (18, 14), options={"movflags": "faststart"}),
    "h264_faststart": lambda: _clip("mp4", "libx264", 25, 3, (18, 14), options={"movflags": "faststart"}),
    "h264_audio_first": lambda: _clip("mp4", "libx264", 24, 2, (16, 16), audio_first=True),
}


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_cut_and_every_changed_header_byte_reads_the_same_both_ways(base: str, tmp_path: Path) -> None:
    data = _base(base)
    path = tmp_path / "edited.mp4"
    served = 0
    for cut in range(len(data)):
        served += _assert_same_both_ways(data[:cut], path)
    span = _moov_span(data)
    media = data.find(b"mdat") + 4  # the first packets: the MPEG-4 decoder takes its size once one decodes
    edited = bytearray(data)
    for pos in [*range(0, 40), *span, *range(media, min(media + 64, len(data)))]:
        original = data[pos]
        for value in {original ^ 0xFF, original ^ 0x01, 0, original + 1 & 0xFF} - {original}:
            edited[pos] = value
            served += _assert_same_both_ways(bytes(edited), path)
        edited[pos] = original
    assert served > len(span)  # most bytes (times, names, flags, tables' padding) do not matter


def test_a_first_mpeg4_packet_too_short_for_its_macroblocks_reads_the_same_both_ways(tmp_path: Path) -> None:
    """libavcodec refuses a first frame with fewer bits than half its macroblock count (and the size
    stays unset): the threshold, here 40 x 23 macroblocks, must be the parser's too."""
    data = _clip("mp4", "mpeg4", 25, 2, (640, 360), options={"movflags": "faststart"})
    stsz = data.find(b"stsz") + 4  # version and flags, one size for all (else 0), count, sizes
    field = stsz + 4 if data[stsz + 4 : stsz + 8] != bytes(4) else stsz + 12
    outcomes = set()
    for size in range(40, 80):
        edited = data[:field] + size.to_bytes(4, "big") + data[field + 4 :]
        outcomes.add(_assert_same_both_ways(edited, tmp_path / "edited.mp4"))
    assert outcomes == {False, True}  # both sides of the threshold were met


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(base=st.sampled_from(sorted(BASES)), edits=st.data())
def test_random_multibyte_edits_read_the_same_both_ways(base: str, edits: st.DataObject, tmp_path: Path) -> None:
    data = bytearray(_base(base))
    media = data.find(b"mdat") + 4
    spots = [*_moov_span(bytes(data)), *range(media, min(media + 64, len(data)))]
    for _ in range(edits.draw(st.integers(1, 6))):
        pos = edits.draw(st.sampled_from(spots))
        data[pos] = edits.draw(st.integers(0, 255))
    _assert_same_both_ways(bytes(data), tmp_path / "edited.mp4")


@functools.cache
def _base(name: str) -> bytes:
    return BASES[name]()


@pytest.mark.parametrize("served", [True, False])
def test_a_table_cell_is_read_from_memory_and_num_bytes_is_its_size(served: bool, tmp_path: Path) -> None:
    """A Parquet cell goes through the same parser; one it hands back reaches PyAV from its start;
    ``video_header`` still sizes the cell."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = _clip("mp4", "libx264", 25, 3, (16, 16), options=None if served else {"movflags": "frag_keyframe"})
    assert (read_mp4_video(io.BytesIO(data)) is not None) == served
    pq.write_table(pa.table({"video": [data]}), tmp_path / "t.parquet")
    ref = MediaRef.table_cell(str(tmp_path / "t.parquet"), 0, ("video",), "clip.mp4")
    header = media.video_header(ref)
    (tmp_path / "clip.mp4").write_bytes(data)
    assert header.meta == _pyav_outcome(tmp_path / "clip.mp4")
    assert header.num_bytes == len(data)
