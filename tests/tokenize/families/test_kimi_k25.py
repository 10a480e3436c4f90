"""Kimi K2.5 VL: the closed form against the real ``Kimi_K25Processor`` (torchvision-only classes).

The processor directory is built offline by :mod:`families.kimi_k25.example` (``prep example
--family kimi_k25``): a small byte-level BPE carrying Kimi's special tokens, K2.5's chat format,
and moonshotai/Kimi-K2.5's image settings (``media_proc_cfg``: patch 14, merge 2,
``in_patch_limit`` 16384, ``patch_limit_on_one_side`` 512).

Two halves:

- unmarked: what runs without torchvision (`/work/venv`, CI's main job). ``load_processor`` keeps
  the image settings as a settings-only object and the counter works from them alone; counts are
  checked against values the real processor gave (the ``torchvision`` half re-derives them).
- ``torchvision``: the real ``Kimi_K25ImageProcessor`` on a dense grid of sizes and random ones
  (tiny, huge, extreme aspect, exactly at the 16384-patch budget and the 7168-px side limit),
  and ``SampleTokenizer`` ids and loss masks against the processor's own ``apply_chat_template``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from PIL import Image

from families.kimi_k25.counter import KimiK25Counter
from families.kimi_k25.example import build_processor_dir
from families.processor import ProcessorBundle, load_processor
from families.registry import find_counter
from tests.tokenize.families import cases

MEDIA_PAD = "<|media_pad|>"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_processor_dir(tmp_path_factory.mktemp("kimi_k25") / "processor")


@pytest.fixture(scope="module")
def bundle(kimi_dir: Path) -> ProcessorBundle:
    return load_processor(str(kimi_dir))


def test_counter_reads_the_checkpoint_settings_with_or_without_torchvision(bundle):
    assert bundle.processor_class == "Kimi_K25Processor"
    counter = find_counter(bundle.processor_class)(bundle)
    assert isinstance(counter, KimiK25Counter)
    s = counter.settings
    assert (s.patch_size, s.merge_size, s.max_patches, s.max_side_patches) == (14, 2, 16384, 512)
    assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids(MEDIA_PAD)


# (width, height) -> (grid_h, grid_w, tokens), as the real processor gave them (transformers 5.24,
# torchvision 0.28); test_grid_equals_the_image_processor checks each again against the processor.
KNOWN = {
    (1920, 1080): (78, 138, 2691),  # under the budget: padded only
    (4000, 3000): (112, 150, 4200),  # scaled by sqrt(16384 / (285 * 214))
    (1, 1): (2, 2, 1),  # never scaled up; padded to one 28 px cell
    (100000, 1): (2, 512, 256),  # the 512-patch side limit, the short side kept at 1 px
    (1792, 1792): (128, 128, 4096),  # exactly 16384 patches: scale 1
}


@pytest.mark.parametrize(("size", "expected"), list(KNOWN.items()))
def test_known_counts_without_pixels(bundle, size, expected):
    count = KimiK25Counter.from_processor(bundle).count_image(*size)
    assert (count.grid_t, count.grid_h, count.grid_w, count.num_tokens) == (1, *expected)
    assert count.expansion == (bundle.tokenizer.convert_tokens_to_ids(MEDIA_PAD),) * expected[2]


# --- against the real processor (torchvision) ----------------------------------------------------


def _sizes() -> list[tuple[int, int]]:
    """A dense grid around the 14 / 28 px steps, the budget and side limits, plus random sizes."""
    sides = [1, 2, 13, 14, 15, 27, 28, 29, 55, 56, 57, 333, 517, 1000]
    grid = [(w, h) for w in sides for h in sides]
    edges = [
        (1792, 1792),  # 128 x 128 patches: exactly the budget
        (1806, 1792),  # 129 x 128: just over it
        (1805, 1805),
        (7168, 14),  # 512 patches: exactly the side limit
        (7169, 14),  # one pixel over
        (7182, 28),
        (20000, 3),  # extreme aspect
        (3, 20000),
        (4100, 20),
        (1920, 1080),
        (4000, 3000),
        (100000, 1),
        (2049, 2047),
        (4096, 4096),
    ]
    rng = random.Random("kimi_k25")
    drawn = []
    for _ in range(60):
        w, h = cases.log_uniform_pair(rng, 6000)
        if rng.random() < 0.2:
            w = 28 * rng.randint(1, 120) + rng.choice([-1, 0, 1])
        drawn.append(cases.maybe_swapped(rng, w, h))
    return grid + edges + drawn


@pytest.mark.torchvision
def test_grid_equals_the_image_processor(bundle):
    """~270 sizes: ``image_grid_thw``, patches and the ``<|media_pad|>`` expansion equal the processor's."""
    pytest.importorskip("torchvision")
    assert bundle.processor is not None, "the real Kimi_K25Processor was not built"
    counter = KimiK25Counter.from_processor(bundle)
    for width, height in [*_sizes(), *KNOWN]:
        image = Image.new("RGB", (width, height))
        out = bundle.processor(text=[MEDIA_PAD], images=[image], add_special_tokens=False, return_tensors="np")
        count = counter.count_image(width, height)
        assert [int(v) for v in out["image_grid_thw"][0]] == [count.grid_t, count.grid_h, count.grid_w], (width, height)
        assert out["pixel_values"].shape[0] == count.grid_h * count.grid_w
        assert [int(t) for t in out["input_ids"][0]] == list(count.expansion), (width, height)
        if (width, height) in KNOWN:
            assert (count.grid_h, count.grid_w, count.num_tokens) == KNOWN[(width, height)]


IMAGES = {**cases.STANDARD_IMAGES, "huge_side": (7300, 30, "RGB", "PNG", None)}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("kimi_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    f = media.file
    one = cases.one_image_records(media, [*IMAGES, "huge"])
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("huge")]),
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")]),
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")], system_turn="Answer briefly."),
        cases.same_image_twice([f("tiny1"), f("ratio205"), f("tiny1")]),
    ]
    return one + many


@pytest.mark.torchvision
def test_sample_tokenizer_equals_the_processor_and_masks_the_replies(bundle, media, tmp_path):
    pytest.importorskip("torchvision")
    from prep.sources.formats.sharegpt import to_conversation
    from prep.tokenize.core import SampleTokenizer

    tokenizer = SampleTokenizer(bundle)
    records = _records(media)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, records)
    media_ids = [bundle.tokenizer.convert_tokens_to_ids(t) for t in ("<|media_begin|>", MEDIA_PAD, "<|media_end|>")]
    for record in records:
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # each reply: the empty think block's close, the text, <|im_end|>; never a prompt or media token
        expected = "".join(f"</think>{r}<|im_end|>" for r in cases.replies(record))
        cases.assert_loss_mask(bundle, sample, expected, media_ids)


@pytest.mark.torchvision
def test_stage_stores_the_processor_ids_and_error_rows(kimi_dir, bundle, media, tmp_path):
    """``prep tokenize --verify-fraction 1``: every row verified, a video's too (test_kimi_k25_video.py)."""
    pytest.importorskip("torchvision")
    records = [*_records(media)[:4], cases.exchange("<video>x", "y", videos=[cases.VIDEO])]
    run = cases.run_stage(tmp_path, kimi_dir, media.root, records)
    assert run.errors == []
    assert len(run.rows) == len(records) and run.manifest.verify.checked == len(run.rows)
    for row, conv in run.conversations(records):
        if all(item.kind == "image" for item in conv.media):  # the video row: verified by the stage
            assert row["input_ids"] == cases.conversation_ids(bundle, conv)
