"""Qwen2.5-Omni / Qwen3-Omni images: the closed form against the real Omni processors.

Processor directories come from :mod:`families.qwen_omni.example` (the ``prep example
--family`` builders): a small byte-level BPE with each checkpoint's special tokens in upstream
order and its named model tokens, the image + Whisper settings of Qwen/Qwen2.5-Omni-7B (patch
14) and Qwen/Qwen3-Omni-30B-A3B-Instruct (patch 16), both 3136..12845056 pixels. Templates:
Qwen2.5-Omni-7B's verbatim; for Qwen3-Omni the Qwen3-VL template plus an audio branch (the
checkpoint's own could not be read offline; image tags and ChatML are the same).

Oracle: the real ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` (built without its video
processor and feature extractor, which images do not touch) through its own
``apply_chat_template(..., tokenize=True)`` on image *paths*, so it decodes and EXIF-transposes
them itself; and its image processor's ``image_grid_thw`` for the property test.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers.utils import is_torchvision_available

from families.processor import ProcessorBundle
from families.qwen_omni.counter import QwenOmniCounter
from families.qwen_omni.example import CHECKPOINTS, build_processor_dir
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases

FAMILIES = list(CHECKPOINTS)  # qwen2_5_omni, qwen3_omni_moe


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("omni")
    return {name: build_processor_dir(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="module")
def omni_bundles(omni_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return cases.load_bundles(omni_dirs)


def test_load_processor_builds_the_real_processor_on_cpu(omni_bundles):
    for name, bundle in omni_bundles.items():
        spec = CHECKPOINTS[name]
        assert bundle.processor_class == spec.processor_class
        assert bundle.processor is not None, "real Omni processor not built (verification would be off)"
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, QwenOmniCounter) and not counter.counts_video
        assert (counter.settings.patch_size, counter.settings.merge_size) == (spec.patch_size, 2)
        assert (counter.settings.min_pixels, counter.settings.max_pixels) == (3136, 12845056)
        image_token = spec.named["image_token"]
        assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids(image_token)
        assert bundle.processor.image_token == image_token
        cases.assert_no_processor_image_kwargs(bundle)


REJECTED = "ratio205"  # > 200:1: smart_resize raises


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("omni_media"), cases.QWEN_RULE_IMAGES, video=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_tokenizer_equals_the_processor(omni_bundles, media, tmp_path, family):
    bundle = omni_bundles[family]
    tokenizer = SampleTokenizer(bundle)
    image_id = tokenizer.counter.image_token_id if tokenizer.counter else -1
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, cases.qwen_rule_records(media))
    for record in cases.qwen_rule_records(media):
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the assistant replies and their <|im_end|>\n, nothing else
        cases.assert_loss_mask(bundle, sample, "".join(r + "<|im_end|>\n" for r in cases.replies(record)), {image_id})
        for _, count in sample.media:
            assert count.num_tiles == 1 and count.num_tokens == len(count.expansion)


@pytest.mark.parametrize("family", FAMILIES)
def test_aspect_over_200_is_an_error_like_the_processor(omni_bundles, media, tmp_path, family):
    cases.assert_rejected_like_processor(omni_bundles[family], tmp_path, media, REJECTED, match="aspect ratio")


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_stores_the_processor_ids_and_error_rows(omni_dirs, omni_bundles, media, tmp_path, family):
    """``prep tokenize`` on a small dataset, every sample verified by the stage too."""
    bad = [
        cases.exchange("<image>x", "y", images=[media.file(REJECTED)]),
        cases.exchange("<video>x", "y", videos=[cases.VIDEO]),
    ]
    records = [r for r in cases.qwen_rule_records(media) if media.file("huge") not in r["images"]][-4:] + bad
    run = cases.run_stage(tmp_path, omni_dirs[family], media.root, records)
    if is_torchvision_available():  # the video is tokenized by the real processor
        assert [e["reason"] for e in run.errors] == ["processor_rejected"]
    else:  # no closed form for Omni video and no processor to run it: an error row, never a guess
        assert sorted(e["reason"] for e in run.errors) == ["processor_rejected", "processor_rejected"]
        assert any("video" in e["message"] for e in run.errors)
        assert len(run.rows) == len(records) - 2
    assert run.manifest.verify.checked == len(run.rows)
    for row, conv in run.conversations(records):
        if all(item.kind == "image" for item in conv.media):
            assert row["input_ids"] == cases.conversation_ids(omni_bundles[family], conv)


@pytest.mark.parametrize("family", FAMILIES)
def test_property_grid_equals_the_image_processor(omni_bundles, family):
    """500 random (width, height): the grid and token count equal the real image processor's."""
    bundle = omni_bundles[family]
    counter = QwenOmniCounter.from_processor(bundle)
    sizes = cases.qwen_rule_sizes(random.Random(f"omni-{family}"), 500, [14, 16, 28, 32])
    cases.assert_qwen_grid_equals_image_processor(bundle, counter, sizes)
