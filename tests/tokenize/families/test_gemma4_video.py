"""Gemma 4 video: the closed form against the real ``Gemma4Processor`` + ``Gemma4VideoProcessor``.

Needs torchvision (HF video processors do): CI runs it in its Python 3.12 environment with
``-m torchvision``. The processor directory is the example's
(:func:`families.gemma4.example.build_gemma4_processor_dir`: ``Gemma4VideoProcessor``'s class
defaults, which the checkpoints' video section repeats -- 70 soft tokens per frame, 32 frames
sampled uniformly), plus a copy whose video config has ``num_frames`` null (the processor then
samples at the dataset's fps).

Truth: the real processor on the video *path*, decoding with transformers' own PyAV reader
and sampling frames itself with the keywords `Gemma4Counter.processor_video_kwargs` gives it
(`prep.tokenize.processor_path.run_processor`, what ``--verify-fraction`` runs); its whole
``input_ids`` must equal the closed-form sample token for token (the ``mm:ss`` timestamps are
ordinary BPE text merging with the template's ``"\\n\\n"``), and its sampled frame indices,
frame count and per-frame soft tokens (from ``video_position_ids``) the stored count. Where the
processor raises (fewer frames than it samples), the closed form is a ``processor_rejected`` row.
Synthetic videos (PyAV) cover tiny, large, extreme-aspect and exactly-at-target sizes, 1 to
240 frames, integer and fractional (NTSC 30000/1001, 12.5, 0.5) rates; hours-long timestamps
(minutes past 99) are checked against ``replace_video_token`` on the processor's own sampler.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from prep.run import LOCAL  # noqa: F401  (imports prep first: its module graph, as the stage does)

pytestmark = pytest.mark.torchvision
pytest.importorskip("torchvision")
pytest.importorskip("av")

from transformers.models.gemma4.processing_gemma4 import Gemma4Processor  # noqa: E402
from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

from families.gemma4.counter import Gemma4Counter  # noqa: E402
from families.gemma4.example import BOI, EOI, IMAGE_SOFT, VIDEO_SOFT, build_gemma4_processor_dir  # noqa: E402
from families.gemma4.settings import VIDEO_CLASS_DEFAULTS, Gemma4VideoSettings  # noqa: E402
from families.processor import ProcessorBundle, load_processor  # noqa: E402
from packvlm.sample_error import SampleError  # noqa: E402
from prep.sources.conversation import Conversation, MediaItem  # noqa: E402
from prep.sources.media import LmdbPool, video_meta  # noqa: E402
from prep.tokenize.core import SampleTokenizer  # noqa: E402
from prep.tokenize.processor_path import run_processor  # noqa: E402
from schemas.dataset_config import VideoSampling  # noqa: E402
from schemas.media import VideoMeta  # noqa: E402
from schemas.media_ref import MediaRef  # noqa: E402
from schemas.reasons import Reason  # noqa: E402
from tests.tokenize.families import cases  # noqa: E402
from tests.video_clips import write_clips  # noqa: E402

# name -> (frames, fps, width, height); sides even (yuv420p)
VIDEOS = {
    "one_frame": (1, 24.0, 64, 48),
    "tiny": (5, 30000 / 1001, 2, 2),
    "short": (8, 4.0, 96, 64),
    "at31": (31, 12.5, 160, 90),
    "at32": (32, 25.0, 432, 336),  # exactly the 70-token target (9 x 7 soft tokens): not resized
    "at33": (33, 30000 / 1001, 128, 96),
    "wide": (40, 10.0, 2000, 16),  # short side floors to 0: 48 px high, capped width
    "tall": (36, 6.0, 16, 1000),
    "hd": (34, 60.0, 1280, 720),
    "slow": (40, 0.5, 100, 74),  # 80 s at half a frame per second: timestamps past a minute
    "long": (240, 30000 / 1001, 32, 24),
}
SAMPLINGS = {
    "default": VideoSampling(),  # fps 2: the processor's own 32 frames
    "every_frame": VideoSampling(fps=None),
    "max8": VideoSampling(fps=2.0, max_frames=8),
    "example": VideoSampling(fps=2.0, min_frames=4, max_frames=64),  # prep example's sampling
}
FPS_SAMPLINGS = {
    "fps2": VideoSampling(fps=2.0),
    "fps0.5": VideoSampling(fps=0.5),
    "fps_every": VideoSampling(fps=None),
    "fps_bounds": VideoSampling(fps=2.0, min_frames=4, max_frames=16),
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma4_processor_dir(tmp_path_factory.mktemp("gemma4v") / "processor")


@pytest.fixture(scope="module")
def bundle(gemma_dir: Path) -> ProcessorBundle:
    return load_processor(str(gemma_dir))


@pytest.fixture(scope="module")
def fps_bundle(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    """The example with ``num_frames: null`` in its video config: the processor samples by fps."""
    path = tmp_path_factory.mktemp("gemma4v_fps") / "processor"
    shutil.copytree(gemma_dir, path)
    cases.edit_json(path / "video_preprocessor_config.json", num_frames=None)
    return load_processor(str(path))


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_clips(tmp_path_factory.mktemp("gemma4v_media"), VIDEOS)


def _conversation(*turns: tuple[list[str], Path | None, str | None]) -> Conversation:
    """User turns (text parts, then a video if given) each followed by a reply when given."""
    messages, media = [], []
    for texts, video, reply in turns:
        content = [{"type": "text", "text": t} for t in texts]
        if video is not None:
            content.insert(len(content) // 2, {"type": "video"})
            media.append(MediaItem(kind="video", ref=MediaRef(path=str(video))))
        messages.append({"role": "user", "content": content})
        if reply is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return Conversation(messages=messages, media=media)


def _truth(bundle: ProcessorBundle, conv: Conversation, sampling: VideoSampling) -> tuple[list[int], object]:
    """The real processor's ids and output, decoding and sampling the video paths itself."""
    _, out, _ = run_processor(bundle, conv, sampling, LmdbPool(), return_metadata=True)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()], out


def _assert_equal_or_both_rejected(bundle: ProcessorBundle, conv: Conversation, sampling: VideoSampling) -> str:
    """Ours equals the processor token for token, or both refuse; returns "ok" / "rejected"."""
    try:
        want, out = _truth(bundle, conv, sampling)
    except SampleError as exc:
        assert exc.reason == Reason.PROCESSOR_REJECTED, exc
        with pytest.raises(SampleError) as ours:
            SampleTokenizer(bundle).tokenize(conv, sampling)
        assert ours.value.reason == Reason.PROCESSOR_REJECTED
        return "rejected"
    sample = SampleTokenizer(bundle).tokenize(conv, sampling)
    assert sample.input_ids == want
    counts = [c for _, c in sample.media if c.kind == "video"]
    metadata = out["video_metadata"]
    assert [list(c.frame_indices) for c in counts] == [[int(i) for i in m.frames_indices] for m in metadata]
    assert [c.grid_t for c in counts] == [int(n) for n in out["num_frames_per_video"]]
    real = (out["video_position_ids"] >= 0).all(dim=-1).sum(dim=-1).tolist()  # real patches per frame
    assert real == [c.grid_h * c.grid_w * 9 for c in counts for _ in range(c.grid_t)]
    assert sum(c.num_tokens for c in counts) == sum(1 for t in want if t == bundle.token_id(VIDEO_SOFT, "x"))
    return "ok"


def test_counter_reads_the_video_processor_and_its_class_defaults(bundle):
    counter = Gemma4Counter.from_processor(bundle)
    processor = bundle.processor
    assert type(processor.video_processor) is Gemma4VideoProcessor
    assert counter.video_token_id == processor.video_token_id == bundle.token_id(VIDEO_SOFT, "x")
    v = counter.video
    vp = processor.video_processor
    assert (v.max_soft_tokens, v.patch_size, v.pooling_kernel_size, v.num_frames) == (70, 16, 3, 32)
    assert (vp.max_soft_tokens, vp.num_frames, vp.do_sample_frames) == (70, 32, True)
    for key, value in VIDEO_CLASS_DEFAULTS.items():  # what the counter assumes where a config is silent
        assert getattr(Gemma4VideoProcessor, key) == value, key


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_video_ids_equal_the_processor(bundle, videos, sampling):
    outcomes = {}
    for name, path in videos.items():
        conv = _conversation((["Look:", "What happens?"], path, "A cat runs."))
        outcomes[name] = _assert_equal_or_both_rejected(bundle, conv, SAMPLINGS[sampling])
    if sampling == "every_frame":
        assert set(outcomes.values()) == {"ok"}
    else:  # fewer frames than the 32 (or 8) sampled: the processor raises
        k = 8 if sampling == "max8" else 32
        assert outcomes == {n: "ok" if VIDEOS[n][0] >= k else "rejected" for n in VIDEOS}


@pytest.mark.parametrize("sampling", list(FPS_SAMPLINGS))
def test_fps_sampling_when_the_config_has_no_num_frames(fps_bundle, videos, sampling):
    chosen = FPS_SAMPLINGS[sampling]
    counter = Gemma4Counter.from_processor(fps_bundle)
    assert counter.video.num_frames is None
    for name, path in videos.items():
        conv = _conversation(([" What happens?"], path, "Nothing."))
        meta = video_meta(MediaRef(path=str(path)))
        if chosen.fps is not None:
            n = max(1, int(meta.num_frames / meta.fps * chosen.fps))
            low, high = chosen.min_frames, chosen.max_frames
            if (low is not None and n < low) or (high is not None and n > high):  # no clamp in the processor
                with pytest.raises(SampleError) as err:
                    SampleTokenizer(fps_bundle).tokenize(conv, chosen)
                assert err.value.reason == Reason.UNSUPPORTED_MEDIA and "min_frames/max_frames" in str(err.value)
                continue
        outcome = _assert_equal_or_both_rejected(fps_bundle, conv, chosen)
        assert outcome == "ok" or (chosen.fps is not None and chosen.fps > meta.fps), name


def test_videos_images_and_text_in_one_conversation(bundle, videos, tmp_path):
    """Two videos, an image and text-only turns; the loss mask covers the replies only."""
    image = tmp_path / "cat.png"
    image.write_bytes(cases.make_image_bytes(333, 517, "RGB", "PNG", None, seed=1))
    conv = _conversation(
        (["Describe"], videos["at33"], "It is a picture."),
        (["abc def"], None, "Same."),
        (["x", "y"], videos["hd"], "Three images."),
    )
    conv.messages[2]["content"].insert(0, {"type": "image"})
    conv.media.insert(1, MediaItem(kind="image", ref=MediaRef(path=str(image))))
    assert _assert_equal_or_both_rejected(bundle, conv, VideoSampling()) == "ok"
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    media_ids = [bundle.token_id(t, "x") for t in (BOI, EOI, IMAGE_SOFT, VIDEO_SOFT)]
    cases.assert_loss_mask(bundle, sample, "It is a picture.<turn|>\nSame.<turn|>\nThree images.<turn|>\n", media_ids)


@pytest.mark.parametrize("total, fps", [(6 * 3600 * 25, 25.0), (200_000, 30000 / 1001), (40, 0.001)])
def test_long_video_timestamps_equal_replace_video_token(bundle, total, fps):
    """Hours-long videos (minutes past 99): the processor's own sampler and text, no decoding."""
    counter = Gemma4Counter.from_processor(bundle)
    processor = bundle.processor
    for sampling in (VideoSampling(), VideoSampling(max_frames=5)):
        meta = VideoMeta(num_frames=total, fps=fps, width=640, height=360)
        count = counter.count_video(meta, sampling)
        metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps, width=640, height=360)
        kwargs = counter.processor_video_kwargs(sampling)
        indices = processor.video_processor.sample_frames(metadata, num_frames=kwargs["num_frames"])
        assert list(count.frame_indices) == [int(i) for i in indices]
        metadata.frames_indices = indices
        fake = SimpleNamespace(boi_token=BOI, eoi_token=EOI, video_token=VIDEO_SOFT)
        inputs = {"num_soft_tokens_per_video": [count.grid_h * count.grid_w], "video_metadata": [metadata]}
        assert count.expansion_text == Gemma4Processor.replace_video_token(fake, inputs, 0)
    assert ":" in count.expansion_text.split(" ", 1)[0]


def test_stage_verifies_every_video_sample(gemma_dir, videos, tmp_path):
    """``prep tokenize`` with every sample verified against the processor: the short clip is a rejected row."""
    media_root = next(iter(videos.values())).parent
    records = [
        cases.exchange("<video>What happens?", "A cat.", videos=[videos[name].name]) for name in ("at32", "hd", "short")
    ]
    run = cases.run_stage(tmp_path, gemma_dir, media_root, records)
    assert [e["reason"] for e in run.errors] == ["processor_rejected"]
    assert len(run.rows) == 2 and run.manifest.verify.checked == 2  # a mismatch fails the stage
    for row in run.rows:
        assert [(m["grid_t"], len(m["frame_indices"])) for m in row["media"]] == [(32, 32)]


def test_without_a_loaded_video_processor_the_settings_come_from_its_config(bundle):
    """No torchvision: the video settings where transformers looks (nested section, video file, image file)."""
    image_only = dataclasses.replace(bundle, processor=None, video_config={"max_soft_tokens": 280, "num_frames": 8})
    assert Gemma4VideoSettings.from_bundle(image_only).max_soft_tokens == 280  # the fallback transformers takes
    nested = dataclasses.replace(image_only, processor_config={"video_processor": {"max_soft_tokens": 140}})
    got = Gemma4VideoSettings.from_bundle(nested)
    assert (got.max_soft_tokens, got.num_frames) == (140, 32)  # a key the section leaves out: the class default
    assert Gemma4VideoSettings.from_bundle(bundle).max_soft_tokens == bundle.processor.video_processor.max_soft_tokens
