"""MiniCPM-V 4.6 video: the closed-form counter against the real ``MiniCPMV4_6Processor`` (torchvision).

The truth is the real processor of transformers 5.24 built from :mod:`families.minicpmv4_6.example`'s
directory (``openbmb/MiniCPM-V-4.6``'s image and video settings: scale_resolution 448, patch 14,
max_slice_nums 9, "16x", max_num_frames 128, stack_frames 1), its ``video_preprocessor_config.json``
rewritten per ``stack_frames`` k; it renders the chat template itself and loads each video from its
path with transformers' PyAV reader (``load_video(backend="pyav")``, as `prep.tokenize.processor_path`
calls it), sampling frames itself. Against it the whole conversation's ``input_ids`` must be equal
token for token, on PyAV videos of tiny, huge and extreme-aspect frames, integer, fractional
(12.5, NTSC 30000/1001) and sub-1 frame rates, sub-second and long (past ``max_num_frames``
seconds) durations, with ``VideoSampling.max_frames`` unset or small; where the processor fails
(k > 1 on videos with fewer frames than stacked timestamps), the counter gives an error row.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.torchvision  # CI runs it in its Python 3.12 environment
pytest.importorskip("torchvision")
pytest.importorskip("av")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402
from transformers.image_utils import load_image  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

from families.counter import MediaRejected  # noqa: E402
from families.minicpmv4_6.counter import MiniCPMV4_6Counter, exact_rate, sample_frames, video_plan  # noqa: E402
from families.minicpmv4_6.example import build_minicpmv4_6_dir  # noqa: E402
from families.processor import ProcessorBundle, load_processor  # noqa: E402
from packvlm.sample_error import SampleError  # noqa: E402
from prep.sources.conversation import Conversation, MediaItem  # noqa: E402
from prep.sources.media import video_meta  # noqa: E402
from prep.tokenize.core import SampleTokenizer  # noqa: E402
from schemas.dataset_config import VideoSampling  # noqa: E402
from schemas.media import MediaKind, VideoMeta  # noqa: E402
from schemas.media_ref import MediaRef  # noqa: E402
from schemas.reasons import Reason  # noqa: E402
from tests.video_clips import real_processor, write_clips  # noqa: E402

STACKS = (1, 2, 3, 5)  # stack_frames: 1 (the checkpoint's), 2 / 3 (canvas layouts of 1..2 frames), 5 (2x2 canvas)
# (frames, fps, width, height): what each case reaches
VIDEOS: dict[str, tuple[int, float, int, int]] = {
    "one_frame": (1, 25, 64, 48),  # 0.04 s: one main frame
    "sub_second": (3, 10, 320, 180),  # 0.3 s, sliced frames (1x2)
    "tiny": (6, 4, 2, 2),  # 2x2 px upscaled to 448^2
    "wide": (5, 2, 1000, 20),  # 50:1, one source frame of 1 x 7 tokens... sliced
    "tall": (4, 2, 20, 600),
    "big": (3, 1, 1920, 1080),  # 3x3 slices of each frame
    "at_area": (4, 2, 448, 448),  # exactly 448^2: unsliced
    "half_fps": (5, 0.5, 100, 300),  # 10 s at 0.5 fps: main indices repeat, the reader keeps each once
    "pal_half": (9, 12.5, 96, 64),  # exact fractional rate
    "ntsc": (46, 30000 / 1001, 200, 120),  # 1.53 s at 29.97 fps
    "whole_seconds": (20, 10, 64, 64),  # exactly 2.0 s
    "long": (45, 10, 96, 64),  # 4.5 s: long past max_frames 3, 0.1 s steps spread over 3
    "long_default": (130, 1, 32, 32),  # 130 s > max_num_frames 128: the checkpoint's long path
}
SAMPLINGS = (None, 3)  # VideoSampling.max_frames: the processor's 128, or 3 (max_num_frames)


def processor_dir(root: Path, stack_frames: int) -> Path:
    """The example processor with ``stack_frames`` set in its video processor config."""
    out = build_minicpmv4_6_dir(root / f"stack{stack_frames}")
    path = out / "video_preprocessor_config.json"
    config = json.loads(path.read_text("utf-8"))
    config["stack_frames"] = stack_frames
    path.write_text(json.dumps(config), "utf-8")
    return out


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[ProcessorBundle, Any]]:
    root = tmp_path_factory.mktemp("minicpmv4_6_video")
    out = {}
    for k in STACKS:
        path = processor_dir(root, k)
        bundle = load_processor(str(path))
        assert bundle.loaded_via == "AutoProcessor" and bundle.processor is not None
        out[k] = (bundle, real_processor(path))
    return out


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_clips(tmp_path_factory.mktemp("minicpmv4_6_clips"), VIDEOS)


def _conversation(parts: list[str | Path]) -> Conversation:
    """One user turn (a Path ending in .mp4 is a video, any other Path an image) and a reply."""
    content: list[dict[str, str]] = []
    media: list[MediaItem] = []
    for part in parts:
        if isinstance(part, Path):
            kind: MediaKind = "video" if part.suffix == ".mp4" else "image"
            content.append({"type": kind})
            media.append(MediaItem(kind=kind, ref=MediaRef(path=str(part))))
        else:
            content.append({"type": "text", "text": part})
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": "Something moves."},
    ]
    return Conversation(messages=messages, media=media)


def _processor_ids(processor: Any, conv: Conversation, max_frames: int | None) -> list[int]:
    text = processor.apply_chat_template(conv.messages, tokenize=False)
    images = [load_image(item.ref.path) for item in conv.media if item.kind == "image"] or None
    videos = [item.ref.path for item in conv.media if item.kind == "video"] or None
    kwargs = {} if max_frames is None else {"max_num_frames": max_frames}
    return [int(t) for t in np.asarray(processor(text=[text], images=images, videos=videos, **kwargs)["input_ids"][0])]


def _assert_equal_or_both_refuse(bundle: ProcessorBundle, processor: Any, conv: Conversation, max_frames: int | None):
    sampling = VideoSampling(max_frames=max_frames)
    try:
        ours: list[int] | SampleError = SampleTokenizer(bundle).tokenize(conv, sampling).input_ids
    except SampleError as exc:
        ours = exc
    try:
        truth: list[int] | Exception = _processor_ids(processor, conv, max_frames)
    except (ValueError, RuntimeError) as exc:  # torch.cat of no unit; a canvas of no frame
        truth = exc
    if isinstance(truth, Exception):
        assert isinstance(ours, SampleError) and ours.reason == Reason.PROCESSOR_REJECTED, (truth, ours)
    else:
        assert ours == truth
    return ours


@pytest.mark.parametrize("stack_frames", STACKS)
@pytest.mark.parametrize("max_frames", SAMPLINGS)
def test_video_equals_processor(processors, videos, stack_frames, max_frames):
    bundle, processor = processors[stack_frames]
    counted = 0
    for name, path in videos.items():
        if name == "long_default" and (stack_frames > 2 or max_frames is not None):
            continue  # 128 main frames (and 128 canvases at k = 2) once is enough
        ours = _assert_equal_or_both_refuse(bundle, processor, _conversation([path, "What happens?"]), max_frames)
        counted += isinstance(ours, list)
    assert counted >= len(VIDEOS) // 2  # most cases are counted, not refused alike


def test_units_and_tiles_equal_the_video_processor(processors, videos):
    """Beyond the ids: units (frames and canvases) and pieces per the video processor's own outputs."""
    for k in (1, 2, 5):
        bundle, processor = processors[k]
        counter = MiniCPMV4_6Counter.from_processor(bundle)
        for name in ("sub_second", "big", "ntsc", "long", "whole_seconds"):
            meta = video_meta(MediaRef(path=str(videos[name])))
            try:
                count = counter.count_video(meta, VideoSampling(max_frames=3))
            except MediaRejected:
                with pytest.raises((ValueError, RuntimeError)):
                    processor.video_processor(videos=[str(videos[name])], max_num_frames=3)
                continue
            out = processor.video_processor(videos=[str(videos[name])], max_num_frames=3)
            assert count.grid_t == out["num_frames_per_video"][0], (k, name)
            assert count.num_tiles == out["target_sizes_videos"].shape[0], (k, name)
            sizes = out["target_sizes_videos"].long()
            assert count.num_tokens == int((sizes[:, 0] * sizes[:, 1] // 16).sum()), (k, name)


def test_images_and_videos_numbered_per_kind(processors, videos, tmp_path):
    """``<image_id>k</image_id>`` counts images and videos apart, each from 0; two sizes of frame."""
    rng = np.random.default_rng(0)
    images = {}
    for name, (w, h) in {"a": (1000, 300), "b": (40, 30)}.items():
        images[name] = tmp_path / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images[name])
    bundle, processor = processors[2]
    conv = _conversation([images["a"], videos["sub_second"], "and", videos["pal_half"], images["b"], videos["ntsc"]])
    ours = _assert_equal_or_both_refuse(bundle, processor, conv, 3)
    assert isinstance(ours, list)
    text = bundle.tokenizer.decode(ours)
    assert [text.count(f"<image_id>{k}</image_id>") for k in range(4)] == [2, 2, 1, 0]


def test_processor_kwargs_and_fps_ignored(processors):
    counter = MiniCPMV4_6Counter.from_processor(processors[1][0])
    assert counter.counts_video
    assert counter.processor_video_kwargs(VideoSampling(fps=4.0)) == {}
    assert counter.processor_video_kwargs(VideoSampling(max_frames=7)) == {"max_num_frames": 7}
    meta = VideoMeta(num_frames=40, fps=10.0, width=64, height=64)
    assert counter.count_video(meta, VideoSampling(fps=1.0)) == counter.count_video(meta, VideoSampling(fps=8.0))


# --- the float duration: where the closed form refuses instead of guessing ------------------------


def test_exact_rates():
    assert exact_rate(30.0) and exact_rate(12.5) and exact_rate(0.5)
    assert not exact_rate(30000 / 1001) and not exact_rate(24000 / 1001)


def test_ntsc_duration_on_a_boundary_is_refused_not_guessed():
    # 30000 frames at 30000/1001: exactly 1001 s; transformers' float(frames / Fraction) is 1001.0,
    # ours (frames / float rate) may differ by an ulp: ceil and int(d / 0.1) would be guesses
    meta = VideoMeta(num_frames=30000, fps=30000 / 1001, width=64, height=64)
    with pytest.raises(MediaRejected, match="boundary"):
        video_plan(meta, max_num_frames=128, stack_frames=1)
    # one frame less is 0.03 s from every boundary: counted
    plan = video_plan(
        VideoMeta(num_frames=29999, fps=30000 / 1001, width=64, height=64), max_num_frames=128, stack_frames=1
    )
    assert len(plan.units) == 128
    # an exact rate on a boundary (300 frames at 30 fps: 10.0 s) is decided exactly: 10 main frames
    assert video_plan(
        VideoMeta(num_frames=300, fps=30.0, width=64, height=64), max_num_frames=128, stack_frames=1
    ).frame_indices == tuple(range(0, 300, 30))


RATES = [
    Fraction(30000, 1001),
    Fraction(24000, 1001),
    Fraction(25),
    Fraction(30),
    Fraction(1, 2),
    Fraction(25, 2),
    Fraction(60000, 1001),
    Fraction(15360000, 512537),
    Fraction(7),
    Fraction(2997, 100),
]


@settings(max_examples=300, deadline=None)
@given(
    frames=st.integers(1, 20000),
    rate=st.sampled_from(RATES),
    max_num_frames=st.sampled_from([1, 2, 3, 8, 64, 128]),
    stack_frames=st.sampled_from([1, 2, 3, 4, 6]),
)
def test_sampled_indices_equal_the_processors(processors, frames, rate, max_num_frames, stack_frames):
    """`sample_frames` against ``MiniCPMV4_6VideoProcessor.sample_frames`` on the metadata the PyAV
    reader builds (duration float(frames / Fraction rate)); wherever the counter decides, its
    indices are the processor's; it refuses only where the float rate leaves the duration open."""
    processor = processors[1][1].video_processor
    metadata = VideoMetadata(total_num_frames=frames, fps=float(rate), duration=float(frames / rate), height=8, width=8)
    truth = processor.sample_frames(metadata, max_num_frames=max_num_frames, stack_frames=stack_frames)
    meta = VideoMeta(num_frames=frames, fps=float(rate), width=8, height=8)
    try:
        video_plan(meta, max_num_frames=max_num_frames, stack_frames=stack_frames)
    except MediaRejected as exc:
        assert "boundary" in str(exc) or "stacks no frame" in str(exc) or "no main frame" in str(exc)
        if "boundary" in str(exc):
            assert not exact_rate(float(rate))
            return
    ours, _ = sample_frames(
        frames, float(rate), frames / float(rate), max_num_frames=max_num_frames, stack_frames=stack_frames
    )
    assert [int(i) for i in ours] == [int(i) for i in truth]
    assert math.ceil(frames / float(rate)) == math.ceil(float(frames / rate))
