"""InternVL 3 / 3.5: the closed-form counter against the real ``InternVLProcessor`` offline.

The processor directory is :mod:`families.internvl.example`'s (``prep example --family
internvl``): the example byte-level BPE plus the InternVL added
tokens (``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<quad>`` ... ``</box>``, ``<video>``, as
transformers' ``convert_internvl_weights_to_hf.write_tokenizer`` adds them to the Qwen2.5
tokenizer, with the same ``extra_special_tokens`` names), the chat template of that script (the
one the ``-hf`` checkpoints ship), and the image / processor settings of
``OpenGVLab/InternVL3-1B-hf`` (``preprocessor_config.json``: GotOcr2, 448x448 tiles,
``crop_to_patches: false``, patches 1..12; ``processor_config.json``: ``image_seq_length`` 256).
InternVL3.5-hf checkpoints share the tokenizer format, template and GotOcr2 settings.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from PIL import Image

from families.internvl.counter import InternVLCounter
from families.internvl.example import build_internvl_dir
from families.processor import ProcessorBundle, load_processor
from prep.sources.conversation import Conversation
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from tests.tokenize.families import cases


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    return load_processor(str(build_internvl_dir(tmp_path_factory.mktemp("internvl"))))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    sizes = {
        **cases.NOISE_SIZES,  # extreme: > 200:1 (Qwen would reject it; InternVL tiles it 12x1)
        "square_tie": (634, 634),  # 1x1 / 2x2 / 3x3 tie broken by area
    }
    return cases.write_noise_images(tmp_path_factory.mktemp("internvl_images"), sizes)


def _conv(turns: list[tuple[str, list[str | Path]]]) -> Conversation:
    """Text-only turns as one string (the template takes both forms)."""
    return cases.conversation(turns, join_text_turns=True)


SINGLE = ["tiny1", "tiny10", "wide", "tall", "extreme", "odd", "odd2", "square_tie", "huge", "exif", "rgba", "gray"]


@pytest.mark.parametrize("name", SINGLE)
def test_single_image_equals_processor(bundle, images, name):
    conv = _conv([("user", [images[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)


def test_crop_to_patches_comes_from_the_processor_class(bundle):
    assert bundle.image_processor.crop_to_patches is False  # the file says false...
    counter = InternVLCounter.from_processor(bundle)
    assert counter.settings.crop_to_patches is True  # ...InternVLProcessor.images_kwargs says True
    assert counter.num_tiles(800, 600) == 13
    assert counter.count_image(800, 600).num_tokens == 13 * 256


def test_many_images_turns_and_touching_text(bundle, images):
    conv = _conv(cases.images_in_turns(images, "exif"))
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == cases.flat_processor_ids(bundle, conv)
    assert [c.kind for _, c in sample.media] == ["image"] * 5
    # loss mask: exactly the assistant replies, each with its <|im_end|>\n
    learned = bundle.tokenizer.decode(cases.learned_ids(sample))
    assert learned == "First answer.<|im_end|>\nSecond answer.<|im_end|>\nThird.<|im_end|>\n"
    ignored = cases.ignored_ids(sample)
    context_id = bundle.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert ignored.count(context_id) == sample.num_media_tokens == sum(c.num_tokens for _, c in sample.media)


def test_video_sample_is_exact_or_a_clear_error_row(bundle, tmp_path):
    err = cases.assert_video_needs_real_processor(bundle, cases.video_conversation(tmp_path / "clip.mp4"))
    assert "real processor" in str(err)


def _random_sizes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """Half fully random (log-uniform sides), half exact grid aspect ratios at random scale (ties)."""
    rng = random.Random(seed)
    grids = [(c, r) for c in range(1, 13) for r in range(1, 13) if c * r <= 12]
    sizes = []
    for i in range(count):
        if i % 2:
            sizes.append((int(2 ** rng.uniform(0, 11.5)), int(2 ** rng.uniform(0, 11.5))))
        else:
            c, r = rng.choice(grids)
            k = rng.randint(1, max(1, 2400 // max(c, r)))
            sizes.append((c * k, r * k))
    return sizes


def test_tile_count_matches_pil_image_processor_on_500_sizes(bundle):
    counter = InternVLCounter.from_processor(bundle)
    ip = bundle.image_processor
    kwargs = {"crop_to_patches": True, "do_rescale": False, "do_normalize": False}
    for width, height in _random_sizes(500):
        image = Image.new("RGB", (width, height), (90, 20, 160))
        num_patches = ip(images=[image], **kwargs)["num_patches"][0]
        assert counter.num_tiles(width, height) == num_patches, (width, height)
        assert counter.count_image(width, height).num_tiles == num_patches, (width, height)  # what tokenize stores


def test_other_image_processor_is_refused_not_guessed(bundle):
    cases.assert_refuses_other_image_processor(InternVLCounter, bundle, "GotOcr2")
