"""Pixtral / Mistral 3 / Ministral 3: the closed form against the real ``PixtralProcessor``.

Two processor directories are built offline by :mod:`families.pixtral.example` (``prep example
--family pixtral`` / ``mistral3``), each with a small byte-level BPE that carries the
Mistral special tokens at their real ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3,
``[/INST]`` 4, ``[IMG]`` 10, ``[IMG_BREAK]`` 12, ``[IMG_END]`` 13, ...):

- ``pixtral_12b``: settings of mistral-community/pixtral-12b (preprocessor_config.json: patch
  16, ``size.longest_edge`` 1024; processor_config.json: patch_size 16, no spatial merge) and
  its chat template (``<s>[INST]...[IMG]...[/INST]reply</s>``).
- ``mistral_small_3_1``: settings of mistralai/Mistral-Small-3.1-24B-Instruct-2503 (also
  Ministral-3: patch 14, ``longest_edge`` 1540, processor patch_size 14,
  ``spatial_merge_size`` 2) and its ``[SYSTEM_PROMPT]`` template, with the default system
  prompt's date left out so renders are deterministic.

Oracle: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (so
it decodes and EXIF-transposes them itself), compared with what ``SampleTokenizer`` and the
``prep tokenize`` stage store, without decoding a pixel on our side.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
from PIL import Image

from families.pixtral.counter import PixtralCounter
from families.pixtral.example import CHECKPOINTS, build_processor_dir
from families.processor import ProcessorBundle
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases


@pytest.fixture(scope="module")
def pixtral_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pixtral")
    return {name: build_processor_dir(root / name, name) for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def pixtral_bundles(pixtral_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return cases.load_bundles(pixtral_dirs)


def test_load_processor_builds_the_real_processor_on_cpu(pixtral_bundles):
    for name, bundle in pixtral_bundles.items():
        patch, merge, longest_edge, _ = CHECKPOINTS[name]
        assert bundle.processor_class == "PixtralProcessor"
        assert bundle.processor is not None, "real PixtralProcessor not built (verification would be off)"
        assert (bundle.processor.patch_size, bundle.processor.spatial_merge_size) == (patch, merge)
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, PixtralCounter)
        assert (counter.settings.patch_size, counter.settings.merge_size, counter.max_height) == (
            patch,
            merge,
            longest_edge,
        )
        assert (counter.image_token_id, counter.image_break_id, counter.image_end_id) == (10, 12, 13)
    a, b = (bundle.identity()["sha256"] for bundle in pixtral_bundles.values())
    assert a != b


IMAGES = {
    **cases.STANDARD_IMAGES,  # ratio205: > 200:1 (Qwen rejects it; Pixtral does not)
    "h1": (1000, 1, "RGB", "PNG", None),  # a 1-pixel side, not floored to 0
    "h3": (40, 3, "RGB", "PNG", None),  # 3 rows: looks like a channel axis to naive code
    "floor0": (3000, 1, "RGB", "PNG", None),  # ratio 2.9 (and 1.9): the short side floors to 0
}
MEDIA_IDS = (10, 12, 13)  # [IMG], [IMG_BREAK], [IMG_END]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("pixtral_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    """ShareGPT records: every image alone, then the combinations the issue asks for."""
    f = media.file
    one = cases.one_image_records(media, [n for n in [*IMAGES, "huge"] if n != "floor0"])
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("huge")]),
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")]),
        cases.same_image_twice([f("tiny1"), f("ratio205"), f("tiny1")]),  # and the 1x1 beside the 205:1
    ]
    return one + many


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_sample_tokenizer_equals_the_processor(pixtral_bundles, media, tmp_path, checkpoint):
    bundle = pixtral_bundles[checkpoint]
    tokenizer = SampleTokenizer(bundle)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, _records(media))
    for record in _records(media):
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the assistant replies and their </s>, nothing else
        cases.assert_loss_mask(bundle, sample, "".join(r + "</s>" for r in cases.replies(record)), MEDIA_IDS)
        assert sample.loss_mask[-1] == 1


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_a_side_flooring_to_zero_is_an_error_like_the_processor(pixtral_bundles, media, tmp_path, checkpoint):
    cases.assert_rejected_like_processor(pixtral_bundles[checkpoint], tmp_path, media, "floor0")


def test_video_is_an_unsupported_media_error(pixtral_bundles):
    cases.assert_video_unsupported(find_counter("PixtralProcessor")(pixtral_bundles["pixtral_12b"]))


def test_stage_stores_the_processor_ids_and_error_rows(pixtral_dirs, pixtral_bundles, media, tmp_path):
    """``prep tokenize`` on a small dataset (mistral_small_3_1), every sample verified by the stage too."""
    bad = [
        cases.exchange("<image>x", "y", images=[media.file("floor0")]),
        cases.exchange("<video>x", "y", videos=[cases.VIDEO]),
    ]
    records = _records(media) + bad
    run = cases.run_stage(tmp_path, pixtral_dirs["mistral_small_3_1"], media.root, records)
    assert sorted(e["reason"] for e in run.errors) == ["processor_rejected", "unsupported_media"]
    assert len(run.rows) == len(records) - 2 and run.manifest.verify.checked == len(run.rows)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(pixtral_bundles["mistral_small_3_1"], conv)


def _system_records(media: cases.MediaFiles) -> list[dict]:
    """A system prompt as the first turn or as ShareGPT's ``system``; one reply, three replies, a last user turn."""
    f = media.file
    system_turn = {"role": "system", "content": "You are a careful visual inspector."}
    last_user = [
        system_turn,
        *cases.exchange("<image>Any defects?", "None.")["messages"],
        {"role": "user", "content": "Sure?"},
    ]
    return [
        {"messages": [system_turn, *cases.exchange("<image>Any defects?", "None.")["messages"]], "images": [f("odd")]},
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")], system_turn="Answer briefly."),
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")], system_field="You are a pirate."),
        {"messages": last_user, "images": [f("odd")]},
    ]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_a_system_turn_keeps_the_processor_ids_and_masks_only_the_replies(pixtral_bundles, media, tmp_path, checkpoint):
    """Regression: pixtral-12b's template writes the system prompt into the *last* user turn only, so
    rendering turn by turn never reproduced the conversation and every such row was a template_error."""
    bundle = pixtral_bundles[checkpoint]
    tokenizer = SampleTokenizer(bundle)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, _system_records(media))
    texts = []
    for record in _system_records(media):
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        cases.assert_loss_mask(bundle, sample, "".join(r + "</s>" for r in cases.replies(record)), MEDIA_IDS)
        texts.append(bundle.tokenizer.decode(sample.input_ids))
    ends_with_reply, *_, ends_with_user = texts
    if checkpoint == "pixtral_12b":  # as the real processor renders it: see README "Model families"
        assert "careful visual inspector" not in ends_with_reply
        assert "[INST]You are a careful visual inspector.\n\nSure?[/INST]" in ends_with_user
    else:  # Mistral Small 3.1: [SYSTEM_PROMPT] first, whatever ends the conversation
        assert "[SYSTEM_PROMPT]You are a careful visual inspector.[/SYSTEM_PROMPT]" in ends_with_reply


def test_stage_keeps_system_turn_rows(pixtral_dirs, pixtral_bundles, media, tmp_path):
    """``prep tokenize --verify-fraction 1`` on pixtral-12b: system-turn rows are stored and verified, none lost."""
    records = _system_records(media)
    run = cases.run_stage(tmp_path, pixtral_dirs["pixtral_12b"], media.root, records)
    assert run.errors == [] and len(run.rows) == len(records) and run.manifest.verify.checked == len(records)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(pixtral_bundles["pixtral_12b"], conv)


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..5000 plus sides near the longest edge and multiples of the patch."""
    sizes = []
    for _ in range(n):
        w, h = cases.log_uniform_pair(rng, 5000)
        if rng.random() < 0.2:
            w = rng.choice([1024, 1025, 1540, 1541, 1536, 1008, 28 * rng.randint(1, 60), 16 * rng.randint(1, 70)])
        sizes.append(cases.maybe_swapped(rng, w, h))
    return sizes


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_property_grid_equals_the_image_processor(pixtral_bundles, checkpoint):
    """500 random (width, height): rows/cols and the [IMG] expansion equal the real processor's."""
    bundle = pixtral_bundles[checkpoint]
    assert bundle.processor is not None
    counter = PixtralCounter.from_processor(bundle)
    patch, merge = counter.settings.patch_size, counter.settings.merge_size
    for width, height in _property_sizes(random.Random(f"pixtral-{checkpoint}"), 500):
        image = Image.new("RGB", (width, height))
        call = partial(bundle.processor, text=["[IMG]"], images=[image], add_special_tokens=False, return_tensors="np")
        out = cases.or_rejected(call, counter, width, height)
        if out is None:
            continue
        count = counter.count_image(width, height)
        resized_h, resized_w = (int(v) for v in out["image_sizes"][0])
        assert (count.grid_h * patch, count.grid_w * patch) == (resized_h, resized_w), (width, height)
        assert list(out["input_ids"][0]) == list(count.expansion), (width, height)
        assert count.num_tokens == (resized_h // (patch * merge)) * (resized_w // (patch * merge))
