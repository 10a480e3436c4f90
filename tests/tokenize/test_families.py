"""Closed-form counters against the processors' own code.

Images: the real (PIL) image processor run on decoded images of every awkward size.
Videos: transformers' own ``sample_frames`` / ``get_num_of_video_patches`` /
``replace_video_token`` (video decoding itself needs torchvision, absent here).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from families.counter import MediaRejected
from families.qwen2_vl.counter import Qwen2VLCounter
from families.qwen3_vl.counter import Qwen3VLCounter
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from tests.tokenize.hf_video_reference import load_qwen2_video_module

IMAGE_SIZES = [
    (1, 1),
    (10, 10),
    (27, 29),
    (56, 56),
    (333, 517),
    (640, 480),
    (1024, 768),
    (3000, 16),
    (16, 3000),
    (2801, 14),
]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_image_grid_matches_image_processor(bundles, family):
    bundle = bundles[family]
    counter = (Qwen2VLCounter if family == "qwen2_vl" else Qwen3VLCounter).from_processor(bundle)
    for width, height in IMAGE_SIZES:
        image = Image.new("RGB", (width, height), (120, 30, 200))
        try:
            grid = bundle.image_processor(images=[image])["image_grid_thw"][0].tolist()
        except ValueError:
            with pytest.raises(MediaRejected):
                counter.count_image(width, height)
            continue
        count = counter.count_image(width, height)
        assert [count.grid_t, count.grid_h, count.grid_w] == grid, (width, height)
        assert count.num_tokens == len(count.expansion) == np.prod(grid) // 4


def test_extreme_aspect_ratio_is_rejected_like_the_processor(bundles):
    counter = Qwen2VLCounter.from_processor(bundles["qwen2_vl"])
    with pytest.raises(ValueError):
        bundles["qwen2_vl"].image_processor(images=[Image.new("RGB", (4100, 20))])
    with pytest.raises(MediaRejected):
        counter.count_image(4100, 20)


VIDEOS = [(37, 30.0, 320, 240), (8, 24.0, 64, 48), (300, 29.97, 640, 360), (5, 2.0, 200, 100), (1000, 60.0, 1920, 1080)]
SAMPLINGS = [VideoSampling(fps=2.0, min_frames=4, max_frames=64), VideoSampling(fps=1.0), VideoSampling(fps=None)]


def test_qwen2_video_plan_matches_transformers(bundles):
    module = load_qwen2_video_module()
    counter = Qwen2VLCounter.from_processor(bundles["qwen2_vl"])
    v = counter.settings.video
    proc = SimpleNamespace(
        num_frames=None,
        fps=v.fps,
        temporal_patch_size=v.temporal_patch_size,
        min_frames=v.min_frames,
        max_frames=v.max_frames,
        size={"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels},
        patch_size=v.patch_size,
        merge_size=v.merge_size,
        cap_pixels_per_frame=None,
        max_video_tokens=v.max_video_tokens,
    )
    cls = module.Qwen2VLVideoProcessor
    for frames, fps, width, height in VIDEOS:
        meta = VideoMeta(num_frames=frames, fps=fps, width=width, height=height)
        md = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps, height=height, width=width)
        for sampling in SAMPLINGS:
            count = counter.count_video(meta, sampling)
            if sampling.fps is not None:
                kwargs = {
                    k: getattr(sampling, k)
                    for k in ("fps", "min_frames", "max_frames")
                    if getattr(sampling, k) is not None
                }
                expected = cls.sample_frames(proc, md, **kwargs).tolist()
            else:
                expected = list(range(frames))
            assert list(count.frame_indices) == expected
            patches = cls.get_num_of_video_patches(proc, len(expected), height, width, {})
            assert count.num_tokens == patches // v.merge_size**2 == len(count.expansion)


def test_qwen3_video_tokens_match_processor_replacement(bundles):
    bundle = bundles["qwen3_vl"]
    counter = Qwen3VLCounter.from_processor(bundle)
    v = counter.settings.video
    for frames, fps, width, height in VIDEOS:
        for sampling in SAMPLINGS:
            overrides = {
                k: getattr(sampling, k) for k in ("min_frames", "max_frames") if getattr(sampling, k) is not None
            }
            hf = Qwen3VLVideoProcessor(**{**bundle.video_config, **overrides})
            meta = VideoMeta(num_frames=frames, fps=fps, width=width, height=height)
            md = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps, height=height, width=width)
            try:
                indices = hf.sample_frames(md, fps=sampling.fps if sampling.fps is not None else hf.fps).tolist()
                patches = hf.get_num_of_video_patches(len(indices), height, width)
            except ValueError:
                with pytest.raises(MediaRejected):
                    counter.count_video(meta, sampling)
                continue
            count = counter.count_video(meta, sampling)
            assert list(count.frame_indices) == indices
            grid_t = -(-len(indices) // v.temporal_patch_size)
            md.frames_indices = indices
            fake = SimpleNamespace(
                video_processor=SimpleNamespace(merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size),
                vision_start_token="<|vision_start|>",
                vision_end_token="<|vision_end|>",
                video_token="<|video_pad|>",
                _calculate_timestamps=lambda i, f, m: Qwen3VLProcessor._calculate_timestamps(None, i, f, m),
            )
            per_frame = patches // grid_t
            grid = np.array([[grid_t, 1, per_frame]])
            text = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": grid, "video_metadata": [md]}, 0)
            expected_ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
            assert list(count.expansion) == expected_ids
            assert count.num_tokens == patches // v.merge_size**2
