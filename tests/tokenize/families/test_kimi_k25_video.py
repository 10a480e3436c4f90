"""Kimi K2.5 video: the closed form (`families.kimi_k25.counter`) against the real processor.

Processor directory: :mod:`families.kimi_k25.example` (moonshotai/Kimi-K2.5's ``media_proc_cfg``
video settings: ``in_patch_limit_each_frame`` 4096, ``temporal_merge_kernel_size`` 4, patch 14,
merge 2, ``patch_limit_on_one_side`` 512). Two halves:

- unmarked (no torchvision): the settings, and frame sampling + the chunk text (``HH:MM:SS.fff``
  timestamps, wrappers) against transformers' own functions: ``default_sample_indices_fn`` and
  ``Kimi_K25Processor.replace_video_token`` (neither imports torchvision), on a dense set of
  frame counts, fractional rates and day-long durations.
- ``torchvision``: the real ``Kimi_K25Processor`` on videos written with PyAV (many sizes and
  aspect ratios, frame counts that are not multiples of 4, fractional fps, a 100,000 s video),
  decoding them itself (transformers' PyAV reader) under each dataset sampling: grids, patch rows
  and the ids of the whole conversation, token for token; ``prep tokenize`` with every row verified.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from families.counter import MediaRejected
from families.kimi_k25.counter import KimiK25Counter
from families.kimi_k25.example import build_processor_dir
from families.processor import ProcessorBundle, load_processor
from prep.sources.conversation import Conversation, MediaItem
from prep.sources.media import video_meta
from schemas.dataset_config import VideoSampling
from schemas.layout import ERRORS_DIR
from schemas.media import VideoMeta
from schemas.media_ref import MediaRef
from schemas.reasons import Reason
from tests.tokenize.families import cases
from tests.video_clips import Clip, real_processor, write_clips

VIDEO_PAD = "<|kimi_k25_video_placeholder|>"
SAMPLINGS = (
    VideoSampling(fps=2.0),  # the dataset default (and the checkpoint's sample_fps)
    VideoSampling(fps=None),  # every frame
    VideoSampling(fps=0.5),
    VideoSampling(fps=3.0),
)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_processor_dir(tmp_path_factory.mktemp("kimi_k25_video") / "processor")


@pytest.fixture(scope="module")
def counter(kimi_dir: Path) -> KimiK25Counter:
    return KimiK25Counter.from_processor(load_processor(str(kimi_dir)))


def test_video_settings_are_the_checkpoints_with_or_without_torchvision(kimi_dir, counter):
    v = counter.settings.video
    assert (v.patch_size, v.merge_size, v.max_patches, v.max_side_patches, v.temporal_patch_size) == (
        14,
        2,
        4096,
        512,
        4,
    )
    tokenizer = load_processor(str(kimi_dir)).tokenizer
    assert counter.video_token_id == tokenizer.convert_tokens_to_ids(VIDEO_PAD) != counter.image_token_id
    # the dataset's sampling is always passed: the processor's own 2 fps default never applies silently
    assert counter.processor_video_kwargs(VideoSampling(fps=None)) == {"do_sample_frames": False}
    assert counter.processor_video_kwargs(VideoSampling(fps=0.5)) == {"fps": 0.5, "do_sample_frames": True}


def test_without_a_video_config_the_image_config_is_read(kimi_dir, tmp_path):
    """No video_preprocessor_config.json: transformers builds the video processor from
    preprocessor_config.json (its 16384-patch budget); the class defaults fill the rest (chunks of 4)."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(kimi_dir, bare)
    (bare / "video_preprocessor_config.json").unlink()
    bundle = load_processor(str(bare))
    v = KimiK25Counter.from_processor(bundle).settings.video
    assert (v.patch_size, v.merge_size, v.max_patches, v.max_side_patches, v.temporal_patch_size) == (
        14,
        2,
        16384,
        512,
        4,
    )
    video_processor = getattr(bundle.processor, "video_processor", None)
    if video_processor is not None:  # torchvision: the loaded class agrees
        assert (video_processor.max_patches, video_processor.temporal_patch_size) == (16384, 4)


# (frames, fps, width, height, sampling fps) -> (chunks, gh, gw, text of chunk 0 and the last),
# as the real processor gave them (transformers 5.24); the torchvision test re-derives each.
KNOWN = {
    (8, 4.0, 64, 48, 2.0): (1, 4, 6, "00:00:00.000", "00:00:00.000"),  # frames 0, 2, 4, 6
    (11, 6.0, 96, 64, None): (3, 6, 8, "00:00:00.000", "00:00:01.333"),  # 4 + 4 + 3 frames
    (37, 30000 / 1001, 1280, 720, None): (10, 50, 86, "00:00:00.000", "00:00:01.201"),  # scaled to 4096 patches
    (1000, 0.01, 16, 16, None): (250, 2, 2, "00:00:00.000", "03:40:00.000"),  # 99,600 s: hours wrap at 24
}


@pytest.mark.parametrize(("key", "expected"), list(KNOWN.items()))
def test_known_counts_without_pixels(counter, key, expected):
    frames, fps, width, height, sample_fps = key
    count = counter.count_video(
        VideoMeta(num_frames=frames, fps=fps, width=width, height=height), VideoSampling(fps=sample_fps)
    )
    chunks, gh, gw, first, last = expected
    assert (count.grid_t, count.grid_h, count.grid_w, count.num_tokens) == (chunks, gh, gw, chunks * gh * gw // 4)
    text = count.expansion_text
    assert text is not None and text.count(VIDEO_PAD) == count.num_tokens and text.count("<|media_begin|>") == chunks
    assert text.startswith(first + "<|media_begin|>video<|media_content|>" + VIDEO_PAD)
    assert text.split("<|media_end|>")[-2].startswith(last)


def _transformers_text(counter: KimiK25Counter, meta: VideoMeta, indices: list[int], grid: tuple[int, int]) -> str:
    """``Kimi_K25Processor.replace_video_token`` on the processor's own metadata object and chunk grids."""
    tps = counter.settings.video.temporal_patch_size
    sizes = [min(tps, len(indices) - s) for s in range(0, len(indices), tps)]
    metadata = VideoMetadata(total_num_frames=meta.num_frames, fps=meta.fps, frames_indices=np.asarray(indices))
    inputs = {
        "num_chunks_per_video": [len(sizes)],
        "video_grid_thw": torch.tensor([[t, *grid] for t in sizes]),
        # the property once (replace_video_token reads it twice per chunk: quadratic on long clips)
        "video_metadata": [SimpleNamespace(fps=metadata.fps, timestamps=metadata.timestamps)],
    }
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=tps), video_token=VIDEO_PAD
    )
    return Kimi_K25Processor.replace_video_token(fake, inputs, 0)


def _metas() -> list[VideoMeta]:
    """Frame counts 1..400 (not multiples of 4 included), integer and NTSC-style rates, random rates, and
    long clips (3600 frames at 1 fps; 100,000 s at 0.01 fps: hours past 24 wrap)."""
    rates = [1.0, 2.0, 6.0, 24.0, 25.0, 30.0, 60.0, 24000 / 1001, 30000 / 1001, 60000 / 1001, 7.5, 0.5, 0.01, 12.5]
    rng = random.Random("kimi_k25_video")
    metas = [VideoMeta(num_frames=n, fps=r, width=64, height=48) for n in (1, 2, 3, 4, 5, 7, 8, 9, 13) for r in rates]
    for _ in range(100):
        if rng.random() < 0.5:
            rate = float(Fraction(rng.uniform(0.01, 120)).limit_denominator(1001))
        else:
            rate = rng.choice(rates)
        metas.append(VideoMeta(num_frames=rng.randint(1, 400), fps=rate, width=64, height=48))
    metas += [
        VideoMeta(num_frames=3600, fps=1.0, width=64, height=48),
        VideoMeta(num_frames=1000, fps=0.01, width=8, height=8),
    ]
    return metas


def test_sampling_and_chunk_text_equal_transformers(counter):
    """~230 clips x 4 samplings: frames, ``ValueError`` <-> MediaRejected, and the whole expansion text."""
    checked = rejected = 0
    for meta in _metas():
        for sampling in SAMPLINGS:
            metadata = VideoMetadata(total_num_frames=meta.num_frames, fps=meta.fps)
            try:
                want = [int(i) for i in default_sample_indices_fn(metadata, fps=sampling.fps)]
            except ValueError:
                with pytest.raises(MediaRejected):
                    counter.count_video(meta, sampling)
                rejected += 1
                continue
            count = counter.count_video(meta, sampling)
            assert list(count.frame_indices) == want, (meta, sampling)
            assert count.expansion_text == _transformers_text(counter, meta, want, (count.grid_h, count.grid_w))
            checked += 1
    assert checked > 500 and rejected > 50


def test_frames_outside_the_datasets_limits_are_refused(counter):
    """The processor has no min / max frames: a sample whose fps sampling falls outside them is an error row."""
    meta = VideoMeta(num_frames=300, fps=30.0, width=64, height=48)  # 10 s: 20 frames at 2 fps
    assert len(counter.count_video(meta, VideoSampling(fps=2.0, min_frames=4, max_frames=64)).frame_indices) == 20
    for sampling in (
        VideoSampling(fps=2.0, max_frames=16),
        VideoSampling(fps=2.0, min_frames=21),
        VideoSampling(fps=None, max_frames=64),  # every frame: 300
    ):
        with pytest.raises(MediaRejected, match="no frame limits"):
            counter.count_video(meta, sampling)


# --- against the real processor (torchvision) ----------------------------------------------------

# (frames, fps, width, height): sizes around the 28 px cells and the 4096-patch budget (896 x 896 is
# exactly 64 x 64 patches), extreme aspect ratios past the 512-patch side, tiny frames, fractional rates
VIDEOS = [
    (8, 4.0, 64, 48),
    (11, 6.0, 96, 64),
    (13, 30000 / 1001, 2, 2),
    (5, 24000 / 1001, 200, 4000),
    (3, 7.5, 7180, 16),
    (2, 25.0, 16, 7180),
    (9, 60.0, 896, 896),
    (6, 12.5, 910, 896),
    (37, 30000 / 1001, 1280, 720),
    (1, 1.0, 30, 58),
    (300, 30.0, 64, 48),
    (1000, 0.01, 16, 16),  # 100,000 s: timestamps past 24 h
]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    clips = {f"v{n}_{w}x{h}": Clip(n, fps, w, h, seed=n) for n, fps, w, h in VIDEOS}
    return list(write_clips(tmp_path_factory.mktemp("kimi_videos"), clips).values())


@pytest.fixture(scope="module")
def processor(kimi_dir: Path) -> Any:
    """The real processor, reading video paths with PyAV (`tests.video_clips`)."""
    pytest.importorskip("torchvision")
    return real_processor(kimi_dir)


def _sampling_kwargs(sampling: VideoSampling) -> dict[str, Any]:
    """The dataset sampling as processor keywords, written out here (not the counter's method)."""
    return {"do_sample_frames": False} if sampling.fps is None else {"do_sample_frames": True, "fps": sampling.fps}


@pytest.mark.torchvision
def test_counts_equal_the_real_processor(processor, counter, videos):
    """Each video x sampling: grids, patch rows and the ids of text touching the video (digits before it)."""
    tokenizer = processor.tokenizer
    text = f"frame 12{VIDEO_PAD}x"
    checked = 0
    for path in videos:
        meta = video_meta(MediaRef(path=str(path)))
        for sampling in SAMPLINGS if meta.num_frames < 1000 else (VideoSampling(fps=None), VideoSampling(fps=0.005)):
            try:
                out = processor(text=[text], videos=[str(path)], return_tensors="pt", **_sampling_kwargs(sampling))
            except ValueError:
                with pytest.raises(MediaRejected):
                    counter.count_video(meta, sampling)
                continue
            count = counter.count_video(meta, sampling)
            grids = out["video_grid_thw"].tolist()
            tps = counter.settings.video.temporal_patch_size
            sizes = [min(tps, len(count.frame_indices) - s) for s in range(0, len(count.frame_indices), tps)]
            assert grids == [[t, count.grid_h, count.grid_w] for t in sizes], (path.name, sampling)
            assert out["pixel_values_videos"].shape[0] == len(count.frame_indices) * count.grid_h * count.grid_w
            assert count.expansion_text is not None
            want = tokenizer(text.replace(VIDEO_PAD, count.expansion_text), add_special_tokens=False)["input_ids"]
            assert out["input_ids"][0].tolist() == want, (path.name, sampling)
            assert count.num_tokens == want.count(counter.video_token_id)
            checked += 1
    assert checked >= 35


def _conversation(turns: list[tuple[str, list[str | tuple[str, Path]]]]) -> Conversation:
    """Turns of (role, parts): ("image" | "video", path) parts are media, str parts text."""
    messages: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for role, parts in turns:
        content: list[dict[str, str]] = []
        for part in parts:
            if isinstance(part, tuple):
                content.append({"type": part[0]})
                media.append(MediaItem(kind=part[0], ref=MediaRef(path=str(part[1]))))  # type: ignore[arg-type]
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": role, "content": content})
    return Conversation(messages=messages, media=media)


@pytest.mark.torchvision
def test_sample_tokenizer_equals_the_processor_and_masks_the_replies(processor, kimi_dir, videos, tmp_path):
    """Whole conversations (video after digits, two videos, video + images, system turn, several turns)."""
    from PIL import Image

    from prep.tokenize.core import SampleTokenizer

    bundle: ProcessorBundle = load_processor(str(kimi_dir))
    tokenizer = SampleTokenizer(bundle)
    image = tmp_path / "odd.png"
    Image.new("RGB", (333, 517), (10, 20, 30)).save(image)
    v = {p.name: p for p in videos}
    clip, odd, wide = v["v8_64x48.mp4"], v["v11_96x64.mp4"], v["v37_1280x720.mp4"]
    conversations = [
        _conversation([("user", ["Frame 12", ("video", clip), "What happens?"]), ("assistant", ["A cat walks."])]),
        _conversation(
            [
                ("system", ["You are helpful."]),
                ("user", [("image", image), "and 7", ("video", odd), ("video", wide), "compare"]),
                ("assistant", ["Both move."]),
                ("user", [("video", clip)]),
                ("assistant", ["Again 3."]),
            ]
        ),
    ]
    media_ids = {bundle.tokenizer.convert_tokens_to_ids(t) for t in ("<|media_begin|>", "<|media_end|>", VIDEO_PAD)}
    for sampling in (VideoSampling(fps=2.0), VideoSampling(fps=None), VideoSampling(fps=3.0)):
        for conv in conversations:
            sample = tokenizer.tokenize(conv, sampling)
            text = processor.apply_chat_template(conv.messages, tokenize=False)
            images = [Image.open(m.ref.path).convert("RGB") for m in conv.media if m.kind == "image"] or None
            paths = [m.ref.path for m in conv.media if m.kind == "video"]
            out = processor(text=[text], images=images, videos=paths, **_sampling_kwargs(sampling))
            assert sample.input_ids == [int(t) for t in out["input_ids"][0]], sampling
            replies = [m["content"][0]["text"] for m in conv.messages if m["role"] == "assistant"]
            cases.assert_loss_mask(bundle, sample, "".join(f"</think>{r}<|im_end|>" for r in replies), media_ids)


@pytest.mark.torchvision
def test_stage_verifies_every_video_row(processor, kimi_dir, videos, tmp_path):
    """``prep tokenize --verify-fraction 1``: video rows checked against the real processor; a video the
    processor cannot sample (more frames than it has) and one outside max_frames are error rows."""
    media_dir = videos[0].parent
    records = [
        cases.exchange("<video>What happens 12?", "It moves.", videos=[p.name])
        for p in videos
        if video_meta(MediaRef(path=str(p))).num_frames < 1000
    ]
    run = cases.run_stage(tmp_path, kimi_dir, media_dir, records)
    # at 2 fps the 1-frame clip at 1 fps would need 2 frames: the processor raises, the stage writes an error row
    assert run.manifest.verify.checked == len(run.rows) == len(records) - 1
    assert [e["reason"] for e in run.errors] == [Reason.PROCESSOR_REJECTED.value]
    for row, conv in run.conversations(records):
        text = processor.apply_chat_template(conv.messages, tokenize=False)
        out = processor(text=[text], videos=[conv.media[0].ref.path], do_sample_frames=True, fps=2.0)
        assert row["input_ids"] == [int(t) for t in out["input_ids"][0]]

    limited = tmp_path / "limited"
    limited.mkdir()
    config, _ = cases.sharegpt_dataset(limited, media_dir, records[:2])
    data = json.loads(config.read_text("utf-8"))
    data["ds"]["video"] = {"fps": 2.0, "max_frames": 1}
    config.write_text(json.dumps(data), "utf-8")
    from prep.run import LOCAL
    from prep.tokenize.stage import TokenizeConfig, run_tokenize

    out_dir = limited / "out"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(kimi_dir),
            output_dir=str(out_dir),
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    errors = cases.read_table(out_dir, ERRORS_DIR)
    assert len(errors) == 2 and all("no frame limits" in e["message"] for e in errors)
