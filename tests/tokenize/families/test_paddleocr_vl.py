"""PaddleOCR-VL: the closed form against the real ``PaddleOCRVLProcessor`` offline.

The processor directory is :mod:`families.paddleocr_vl.example`'s (``prep example --family
paddleocr_vl``): a small byte-level BPE carrying the ERNIE-4.5 specials and the PaddleOCR-VL
added tokens, the PaddlePaddle/PaddleOCR-VL chat template (images of a user turn first, then
its text; list content only) and its ``preprocessor_config.json`` settings: patch 14, merge 2,
temporal patch 1, ``min_pixels`` 147384, ``max_pixels`` 2822400.

Oracles: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (it
decodes and EXIF-transposes them itself) and its PIL image processor's ``image_grid_thw`` /
``pixel_values`` on a dense grid of edge sizes plus hypothesis-drawn ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from families.paddleocr_vl.counter import PaddleOCRVLCounter
from families.paddleocr_vl.example import build_paddleocr_vl_dir
from families.processor import ProcessorBundle, load_processor
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases

MIN_PIXELS, MAX_PIXELS = 147384, 2822400  # PaddlePaddle/PaddleOCR-VL preprocessor_config.json


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_paddleocr_vl_dir(tmp_path_factory.mktemp("paddleocr_vl"))


@pytest.fixture(scope="module")
def bundle(processor_dir: Path) -> ProcessorBundle:
    return load_processor(str(processor_dir))


@pytest.fixture(scope="module")
def counter(bundle: ProcessorBundle) -> PaddleOCRVLCounter:
    found = find_counter(bundle.processor_class)
    assert found is not None
    made = found(bundle)
    assert isinstance(made, PaddleOCRVLCounter)
    return made


def test_load_processor_builds_the_real_processor_on_cpu(bundle, counter):
    assert bundle.processor_class == "PaddleOCRVLProcessor"
    assert bundle.processor is not None, "real processor not built (verification would be off)"
    # the PIL backend here; with torchvision installed transformers picks its torchvision backend
    # (same smart_resize): these tests pass in both environments
    assert type(bundle.image_processor).__name__ in ("PaddleOCRVLImageProcessorPil", "PaddleOCRVLImageProcessor")
    s = counter.settings
    assert (s.patch_size, s.merge_size, s.temporal_patch_size) == (14, 2, 1)
    assert (s.min_pixels, s.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert s.image_token_id == bundle.processor.image_token_id
    assert s.image_token_id == bundle.tokenizer.convert_tokens_to_ids("<|IMAGE_PLACEHOLDER|>")
    cases.assert_no_processor_image_kwargs(bundle)
    # the template renders only content lists: string turns go in as lists (prep.tokenize.content_style)
    assert SampleTokenizer(bundle).content_lists


IMAGES = {
    **cases.STANDARD_IMAGES,  # wide 3000x16: height scaled up to 28 first (5250 x 28); ratio205 rejected
    "ratio200": (4000, 20, "RGB", "PNG", None),  # 5600 x 28 after the scale-up: exactly 200:1, accepted
    "thin": (3000, 1, "RGB", "PNG", None),  # 84000 x 28: rejected
    "at_max": (1680, 1680, "RGB", "JPEG", None),  # exactly max_pixels: kept
}
REJECTED = ("ratio205", "thin")


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("paddleocr_vl_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    """ShareGPT records: every accepted image alone, then several images per turn and per conversation."""
    f = media.file
    one = cases.one_image_records(media, [name for name in [*IMAGES, "huge"] if name not in REJECTED])
    three_turns = cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")], system_turn="You are helpful.")
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("exif8")]),
        three_turns,
        cases.same_image_twice([f("tiny1"), f("ratio200"), f("tiny1")]),
    ]
    return one + many


def test_sample_tokenizer_equals_the_processor(bundle, media, tmp_path):
    tokenizer = SampleTokenizer(bundle)
    special = {bundle.tokenizer.convert_tokens_to_ids(t) for t in ("<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>")}
    records = _records(media)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, records)
    for record in records:
        conv = tokenizer.for_template(to_conversation(record, spec))
        sample = cases.assert_ids_equal_processor(tokenizer, conv, record["images"])
        # loss mask: each reply and the </s> that ends it, nothing of "Assistant:\n" or the user turns
        cases.assert_loss_mask(bundle, sample, "".join(r + "</s>" for r in cases.replies(record)), special)
        assert sample.loss_mask[-1] == 1
        for _, count in sample.media:
            assert count.num_tiles == 1 and count.grid_t == 1


@pytest.mark.parametrize("name", REJECTED)
def test_aspect_over_200_is_an_error_like_the_processor(bundle, media, tmp_path, name):
    cases.assert_rejected_like_processor(bundle, tmp_path, media, name, match="aspect ratio")


def test_video_is_an_unsupported_media_error(counter):
    err = cases.assert_video_unsupported(counter)
    assert "images only" in str(err)


def test_other_image_processor_is_refused_not_guessed(bundle):
    cases.assert_refuses_other_image_processor(PaddleOCRVLCounter, bundle, "PaddleOCRVLImageProcessor")


def _assert_grid_equals_image_processor(bundle: ProcessorBundle, counter: PaddleOCRVLCounter, width: int, height: int):
    image = Image.new("RGB", (width, height))
    flags = {"do_rescale": False, "do_normalize": False, "return_tensors": "np"}
    out = cases.or_rejected(lambda: bundle.image_processor(images=[image], **flags), counter, width, height)
    if out is None:
        return False
    count = counter.count_image(width, height)
    assert [int(v) for v in out["image_grid_thw"][0]] == [count.grid_t, count.grid_h, count.grid_w], (width, height)
    assert out["pixel_values"].shape[0] == count.num_tokens * 4 == count.grid_h * count.grid_w, (width, height)
    assert count.expansion == (counter.image_token_id,) * count.num_tokens
    return True


# (width, height): sides under 28 in each order of the two scale-ups, round-half-even sides
# (14, 42, 1694 = 60.5 x 28), the area around min_pixels (187 vs 188 cells of 28x28; 147384 is
# not a multiple of 784) and around max_pixels (1680 x 1680 = max exactly), ratios at 200:1.
EDGE_SIZES = [
    (1, 1), (2, 1), (1, 2), (3, 10), (10, 3), (27, 27), (28, 28), (29, 29), (14, 14), (42, 42),
    (41, 2), (2, 41), (27, 5400), (5400, 27), (5600, 28), (5628, 28), (28, 5600), (28, 5628),
    (308, 476), (476, 308), (112, 1316), (1316, 112), (307, 476), (309, 476), (1680, 1680),
    (1680, 1708), (1708, 1680), (1694, 1694), (1694, 1666), (1681, 1680), (3000, 1), (1, 3000),
    (4000, 20), (4020, 20), (384, 384), (1024, 768), (1920, 1080), (2480, 3508),
]  # fmt: skip


def test_edge_sizes_equal_the_image_processor(bundle, counter):
    accepted = [_assert_grid_equals_image_processor(bundle, counter, w, h) for w, h in EDGE_SIZES]
    assert 0 < accepted.count(False) < len(accepted)  # both branches exercised


def test_module_docstring_examples(counter):
    assert counter.count_image(300, 40).num_tokens == 228
    assert (counter.count_image(300, 40).grid_h, counter.count_image(300, 40).grid_w) == (12, 76)
    assert counter.count_image(1, 1).num_tokens == 196


def _log_side(top: int) -> st.SearchStrategy[int]:
    return st.floats(0, np.log(top)).map(lambda x: max(1, int(np.exp(x))))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(width=_log_side(3500), height=_log_side(3500))
def test_property_grid_equals_the_image_processor(bundle, counter, width, height):
    _assert_grid_equals_image_processor(bundle, counter, width, height)


def test_stage_stores_the_processor_ids_and_error_rows(processor_dir, bundle, media, tmp_path):
    """``prep tokenize`` on a small dataset, every sample verified by the stage too."""
    bad = [
        cases.exchange("<image>x", "y", images=[media.file("ratio205")]),
        cases.exchange("<video>x", "y", videos=[cases.VIDEO]),
    ]
    records = _records(media)[-3:] + bad
    run = cases.run_stage(tmp_path, processor_dir, media.root, records)
    assert sorted(e["reason"] for e in run.errors) == ["processor_rejected", "unsupported_media"]
    assert len(run.rows) == len(records) - 2 and run.manifest.verify.checked == len(run.rows)
    tokenizer = SampleTokenizer(bundle)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(bundle, tokenizer.for_template(conv))
