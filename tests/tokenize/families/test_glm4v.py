"""GLM-4.1V / 4.5V / 4.6V: the closed form against the real ``Glm4vProcessor`` / ``Glm46VProcessor``.

Two processor directories are built offline by :mod:`families.glm4v.example`, each a small
byte-level BPE (GLM-4 split) carrying the GLM special tokens in upstream order and the image
settings patch 14, temporal patch 2, merge 2, pixels 12544..9633792:

- ``glm4_1v``: ``Glm4vProcessor``, zai-org/GLM-4.1V-9B-Thinking (and GLM-4.5V) settings, the
  GLM-4.1V-9B-Thinking chat template verbatim;
- ``glm4_6v``: ``Glm46VProcessor``, zai-org/GLM-4.6V / GLM-OCR settings, GLM-OCR's chat
  template verbatim (the 4.5V/4.6V format with think blocks and tools).

Oracle: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (it
decodes and EXIF-transposes them itself) and its PIL image processor's ``image_grid_thw``,
compared with what ``SampleTokenizer`` and the ``prep tokenize`` stage store without
decoding a pixel.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from families.glm4v.counter import Glm4vCounter
from families.glm4v.example import GLM_CHECKPOINTS, build_glm4v_dir
from families.processor import ProcessorBundle
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases

PROCESSOR_CLASS = {name: classes[0] for name, classes in GLM_CHECKPOINTS.items()}
# What each template renders before an assistant reply, inside the reply's turn (the 4.5V/4.6V
# format writes an empty think block for a reply without reasoning).
REPLY_PREFIX = {"glm4_1v": "", "glm4_6v": "<think></think>\n"}


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4v")
    return {name: build_glm4v_dir(root / name, name) for name in GLM_CHECKPOINTS}


@pytest.fixture(scope="module")
def glm_bundles(glm_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return cases.load_bundles(glm_dirs)


def test_load_processor_builds_the_real_processor_on_cpu(glm_bundles):
    for name, bundle in glm_bundles.items():
        assert bundle.processor_class == PROCESSOR_CLASS[name]
        assert bundle.processor is not None, "real processor not built (verification would be off)"
        assert type(bundle.image_processor).__name__.endswith("ImageProcessorPil")
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, Glm4vCounter)
        s = counter.settings
        assert (s.patch_size, s.image_temporal_patch_size, s.merge_size) == (14, 2, 2)
        assert (s.min_pixels, s.max_pixels) == (12544, 9633792)
        assert counter.image_token_id == bundle.processor.image_token_id
        assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids("<|image|>")


IMAGES = {
    **cases.STANDARD_IMAGES,  # wide: short side scaled up to 28 first, 5250x28; ratio205: 28 x 5740 after it, rejected
    "ratio199": (5572, 28, "RGB", "PNG", None),  # 199:1, accepted
    "thin": (3000, 1, "RGB", "PNG", None),  # 1 px side -> 84000 x 28: rejected
}
REJECTED = ("ratio205", "thin")


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("glm4v_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    """ShareGPT records: every accepted image alone, then the combinations the issue asks for."""
    f = media.file
    one = cases.one_image_records(media, [name for name in IMAGES if name not in REJECTED])
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("huge")]),
        {  # images in several turns, with a system prompt
            "messages": [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "And here?<image>"},
                {"role": "assistant", "content": "A dog on a red table."},
                {"role": "user", "content": "12<image>34"},
                {"role": "assistant", "content": "120 trees."},
            ],
            "images": [f("rgba"), f("gray"), f("tall")],
        },
        cases.same_image_twice([f("tiny1"), f("ratio199"), f("tiny1")]),  # and the 1x1 beside the 199:1
    ]
    return one + many


@pytest.mark.parametrize("checkpoint", list(GLM_CHECKPOINTS))
def test_sample_tokenizer_equals_the_processor(glm_bundles, media, tmp_path, checkpoint):
    bundle = glm_bundles[checkpoint]
    tokenizer = SampleTokenizer(bundle)
    image_ids = {bundle.tokenizer.convert_tokens_to_ids(t) for t in ("<|begin_of_image|>", "<|image|>")}
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, _records(media))
    for record in _records(media):
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the assistant turns (the templates end a reply with nothing)
        cases.assert_loss_mask(
            bundle, sample, "".join(REPLY_PREFIX[checkpoint] + r for r in cases.replies(record)), image_ids
        )
        assert sample.loss_mask[-1] == 1
        for _, count in sample.media:
            assert count.num_tiles == 1 and count.grid_t == 1


@pytest.mark.parametrize("name", REJECTED)
def test_aspect_over_200_is_an_error_like_the_processor(glm_bundles, media, tmp_path, name):
    cases.assert_rejected_like_processor(glm_bundles["glm4_1v"], tmp_path, media, name, match="aspect ratio")


def test_video_is_the_real_processor_or_a_clear_error_row(glm_bundles, media, tmp_path):
    bundle = glm_bundles["glm4_1v"]
    assert Glm4vCounter.counts_video is False
    record = cases.exchange("<video>What happens?", "y", videos=[cases.VIDEO])
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, [record])
    err = cases.assert_video_needs_real_processor(bundle, to_conversation(record, spec))
    assert "real processor" in str(err)


def test_other_image_processor_is_refused_not_guessed(glm_bundles):
    cases.assert_refuses_other_image_processor(Glm4vCounter, glm_bundles["glm4_1v"], "Glm4vImageProcessor")


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..1500, a third with a side under 28 (the scale-up), some on 28-multiples."""
    sizes = []
    for i in range(n):
        w, h = cases.log_uniform_pair(rng, 1500)
        if i % 3 == 0:
            h = rng.randint(1, 27)
        elif i % 7 == 0:
            w = 28 * rng.randint(1, 50) + rng.choice([-1, 0, 1, 14])
        sizes.append(cases.maybe_swapped(rng, w, h))
    return sizes


@pytest.mark.parametrize("checkpoint", list(GLM_CHECKPOINTS))
def test_property_grid_equals_the_image_processor(glm_bundles, checkpoint):
    """500 random (width, height): grid and token count equal the PIL image processor's ``image_grid_thw``."""
    bundle = glm_bundles[checkpoint]
    counter = Glm4vCounter.from_processor(bundle)
    ip = bundle.image_processor
    rejected = 0
    for width, height in _property_sizes(random.Random(f"glm-{checkpoint}"), 500):
        image = Image.new("RGB", (width, height))
        out = cases.or_rejected(
            partial(ip, images=[image], do_rescale=False, do_normalize=False), counter, width, height
        )
        if out is None:
            rejected += 1
            continue
        grid = out["image_grid_thw"][0]
        count = counter.count_image(width, height)
        assert (count.grid_t, count.grid_h, count.grid_w) == tuple(int(v) for v in grid), (width, height)
        assert count.num_tokens == int(np.prod(grid)) // 4 == len(count.expansion), (width, height)
    assert 0 < rejected < 250  # both branches exercised


def test_pixel_budget_counts_the_temporal_patch(glm_bundles):
    """Over max_pixels / 2 (not max_pixels) the image is scaled down: 4000x3000 -> 2520x1876 (w x h)."""
    counter = Glm4vCounter.from_processor(glm_bundles["glm4_1v"])
    ip = glm_bundles["glm4_1v"].image_processor
    for width, height in ((4000, 3000), (2600, 1800), (1920, 1080)):
        grid = ip(images=[Image.new("RGB", (width, height))], do_rescale=False, do_normalize=False)["image_grid_thw"]
        count = counter.count_image(width, height)
        assert (count.grid_h, count.grid_w) == tuple(int(v) for v in grid[0][1:])
        assert 2 * count.grid_h * count.grid_w * 14 * 14 <= counter.settings.max_pixels
    assert counter.count_image(1920, 1080).num_tokens == 2691  # the module docstring's example


def test_stage_stores_the_processor_ids_and_error_rows(glm_dirs, glm_bundles, media, tmp_path):
    """``prep tokenize`` on a small dataset (glm4_6v), every sample verified by the stage too."""
    bad = [
        cases.exchange("<image>x", "y", images=[media.file("ratio205")]),
        cases.exchange("<video>x", "y", videos=[cases.VIDEO]),
    ]
    records = _records(media)[-2:] + bad
    run = cases.run_stage(tmp_path, glm_dirs["glm4_6v"], media.root, records)
    assert [e["reason"] for e in run.errors] == ["processor_rejected", "processor_rejected"]
    assert len(run.rows) == len(records) - 2 and run.manifest.verify.checked == len(run.rows)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(glm_bundles["glm4_6v"], conv)
