"""MiniCPM-V 4.6: the closed-form counter against the real ``MiniCPMV4_6Processor`` offline.

The processor directory is :mod:`families.minicpmv4_6.example`'s (``prep example --family
minicpmv4_6``): the Qwen3.5 example tokenizer and template plus MiniCPM-V's markup tokens
(``<image>``, ``</image>``, ``<slice>``, ``</slice>``, ``<image_id>``, ``</image_id>``), and the
image settings of ``openbmb/MiniCPM-V-4.6`` as transformers 5.24's
``MiniCPMV4_6ImageProcessorPil`` declares them: scale_resolution 448, patch_size 14,
max_slice_nums 9, slice_mode true, downsample_mode "16x", use_image_id true. Without
torchvision the processor is built with the PIL image processor and no video processor
(`families.processor`); its image path is the real class's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from families.minicpmv4_6.counter import MiniCPMV4_6Counter
from families.minicpmv4_6.example import build_minicpmv4_6_dir
from families.processor import ProcessorBundle, load_processor
from prep.sources.conversation import Conversation
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from tests.tokenize.families import cases


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    return load_processor(str(build_minicpmv4_6_dir(tmp_path_factory.mktemp("minicpmv4_6"))))


@pytest.fixture(scope="module")
def counter(bundle: ProcessorBundle) -> MiniCPMV4_6Counter:
    return MiniCPMV4_6Counter.from_processor(bundle)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    sizes = {
        **cases.NOISE_SIZES,  # extreme 4100x20: one unsliced source image 56 x 6328 px
        "at_area": (448, 448),  # exactly 448^2 pixels: not sliced, not resized
        "past_area": (449, 448),  # one pixel more: 2 slices
        "nine": (1344, 1344),  # 9 = max_slice_nums: grid 3x3
        "many": (3000, 2000),  # past 9: capped
    }
    return cases.write_noise_images(tmp_path_factory.mktemp("minicpmv4_6_images"), sizes)


def _conv(turns: list[tuple[str, list[str | Path]]]) -> Conversation:
    return cases.conversation(turns, join_text_turns=True)


SINGLE = [
    "tiny1",
    "tiny10",
    "wide",
    "tall",
    "extreme",
    "odd",
    "odd2",
    "at_area",
    "past_area",
    "nine",
    "many",
    "huge",
    "exif",
    "rgba",
    "gray",
]


def test_processor_is_the_real_class(bundle):
    assert bundle.processor_class == "MiniCPMV4_6Processor"
    if bundle.loaded_via == "AutoProcessor":  # torchvision present: the whole processor
        assert type(bundle.processor).__name__ == "MiniCPMV4_6Processor"
        return
    # without torchvision: the real class, its video settings read from the file for __init__ only
    assert type(bundle.processor).__mro__[1].__name__ == "MiniCPMV4_6Processor"
    assert bundle.processor.video_processor is None  # a video sample still reports torchvision missing
    assert bundle.processor.video_slice_mode is True


@pytest.mark.parametrize("name", SINGLE)
def test_single_image_equals_processor(bundle, images, name):
    conv = _conv([("user", [images[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)


def test_worked_example(counter):
    plan = counter.plan(1000, 300)  # the counter module's docstring
    assert plan.grid == (1, 3)
    assert plan.source_size == (16, 60) and plan.source_tokens == 60
    assert plan.slice_size == (32, 32) and plan.slice_tokens == 64
    assert counter.count_image(1000, 300).num_tokens == 60 + 3 * 64


def test_many_images_turns_and_touching_text(bundle, images):
    conv = _conv(cases.images_in_turns(images, "exif"))
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)
    assert [c.kind for _, c in sample.media] == ["image"] * 5
    learned = bundle.tokenizer.decode(cases.learned_ids(sample))
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"
    pad = bundle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ignored = cases.ignored_ids(sample)
    assert ignored.count(pad) == sample.num_media_tokens == sum(c.num_tokens for _, c in sample.media)


def test_image_ids_count_per_sample_past_ten(bundle, images):
    """``<image_id>k</image_id>`` is the image's place in its sample: 0..11 (two-digit ids are text)."""
    names = ["tiny1", "odd", "wide", "tall", "gray", "rgba", "tiny10", "odd2", "at_area", "past_area", "nine", "exif"]
    conv = _conv([("user", [*(images[n] for n in names), "All of them?"]), ("assistant", ["Yes."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)
    text = bundle.tokenizer.decode(sample.input_ids)
    assert [text.count(f"<image_id>{k}</image_id>") for k in range(12)] == [1] * 12


def test_one_tokenizer_renumbers_remembered_sizes(bundle, images):
    """One worker's tokenizer remembers each size per place (`prep.tokenize.count_memo`): a size met
    first as image 0 and later as image 1 or 2 (and back) must carry the processor's ``<image_id>``."""
    tok = SampleTokenizer(bundle)
    for names in (["wide", "tall"], ["tall", "wide", "wide"], ["wide"], ["tall", "tall", "wide"]):
        conv = _conv([("user", [*(images[n] for n in names), "And these?"]), ("assistant", ["Fine."])])
        assert tok.tokenize(conv, VideoSampling()).input_ids == cases.flat_processor_ids(bundle, conv), names


def test_video_is_counted_without_the_processor(bundle, tmp_path):
    """The counter module's worked example; against the real processor: test_minicpmv4_6_video.py (torchvision)."""
    clip = cases.write_video(tmp_path / "clip.mp4", 46, 30000 / 1001, 200, 120)
    sample = SampleTokenizer(bundle).tokenize(cases.video_conversation(clip), VideoSampling())
    ((_, count),) = sample.media
    assert (count.frame_indices, count.grid_t, count.num_tokens, count.num_tiles) == ((0, 29), 2, 120, 2)


def _grid_sizes() -> list[tuple[int, int]]:
    """Sizes around every threshold: the 448^2 area, each grid's exact aspect, and log-uniform sides."""
    rng = random.Random(0)
    sizes = [(1, 1), (1, 4000), (4000, 1), (2, 3), (448, 448), (449, 448), (448, 449), (447, 449)]
    for rows in range(1, 10):
        for cols in range(1, 10):
            if rows * cols <= 10:
                k = rng.randint(1, 2400 // max(rows, cols))
                sizes.append((cols * k, rows * k))
    sizes += [cases.log_uniform_pair(rng, 3500) for _ in range(60)]
    return sizes


def _processor_plan(bundle: ProcessorBundle, width: int, height: int) -> tuple[list[list[int]], list[int]]:
    got = bundle.image_processor(images=[Image.new("RGB", (width, height))], do_rescale=False, do_normalize=False)
    return [[int(v) for v in ts] for ts in got["target_sizes"]], [int(v) for v in got["grids"][0]]


def _counter_plan(counter: MiniCPMV4_6Counter, width: int, height: int) -> tuple[list[list[int]], list[int]]:
    plan = counter.plan(width, height)
    return [list(plan.source_size)] + [list(plan.slice_size)] * plan.num_slices, list(plan.grid or (0, 0))


def test_slices_match_the_pil_image_processor_on_a_size_grid(bundle, counter):
    for width, height in _grid_sizes():
        assert _counter_plan(counter, width, height) == _processor_plan(bundle, width, height), (width, height)


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 3000), height=st.integers(1, 3000))
def test_slices_match_the_pil_image_processor_hypothesis(bundle, counter, width, height):
    assert _counter_plan(counter, width, height) == _processor_plan(bundle, width, height)


def test_other_image_processor_is_refused_not_guessed(bundle):
    cases.assert_refuses_other_image_processor(MiniCPMV4_6Counter, bundle, "MiniCPMV4_6")
