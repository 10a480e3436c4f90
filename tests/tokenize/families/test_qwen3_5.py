"""Qwen3.5: the Qwen3-VL counter against the real ``Qwen3VLProcessor`` with Qwen3.5 settings.

transformers 5.23 serves Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) with ``Qwen3VLProcessor`` +
``Qwen2VLImageProcessorPil`` + ``Qwen3_5Tokenizer``; the processor class name is Qwen3-VL's, so
:class:`families.qwen3_vl.counter.Qwen3VLCounter` serves it. The processor directory is
:mod:`families.qwen3_vl.example`'s (``prep example --family qwen3_5``): Qwen/Qwen3.5-27B's
processor and tokenizer classes and vision settings (patch 16, merge 2, from
``configuration_qwen3_5``), Qwen3-VL's pixel limits (65536..16777216) and chat template (the
Qwen3.5 checkpoint files could not be read offline). The Qwen3.5 tokenizer's own pre-tokenizer
(combining marks kept with letters) is exercised by text touching the image tag.

Oracle: the real processor's ``apply_chat_template(..., tokenize=True)`` on image paths, and
its image processor's ``image_grid_thw`` / ``pixel_values`` for 500 random sizes.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from families.processor import ProcessorBundle, load_processor
from families.qwen3_vl.counter import Qwen3VLCounter
from families.qwen3_vl.example import build_processor_dir
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_processor_dir(tmp_path_factory.mktemp("qwen3_5") / "processor")


@pytest.fixture(scope="module")
def bundle(q35_dir: Path) -> ProcessorBundle:
    return load_processor(str(q35_dir))


def test_qwen3_5_loads_as_qwen3_vl_processor_with_its_own_tokenizer(bundle, q35_dir):
    assert json.loads((q35_dir / "config.json").read_text())["model_type"] == "qwen3_5"
    assert bundle.processor_class == "Qwen3VLProcessor"
    assert bundle.processor is not None, "real Qwen3VLProcessor not built (verification would be off)"
    assert type(bundle.tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert type(bundle.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    counter = find_counter(bundle.processor_class)(bundle)
    assert isinstance(counter, Qwen3VLCounter)
    assert (counter.settings.patch_size, counter.settings.merge_size) == (16, 2)
    assert (counter.settings.min_pixels, counter.settings.max_pixels) == (65536, 16777216)
    assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cases.assert_no_processor_image_kwargs(bundle)


REJECTED = "ratio205"  # > 200:1: smart_resize raises


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("qwen3_5_media"), cases.QWEN_RULE_IMAGES)


def _records(media: cases.MediaFiles) -> list[dict]:
    """ShareGPT records: the Qwen-rule cases, then combining marks (Qwen3.5's pre-tokenizer keeps them
    with letters) touching the tag."""
    marks = cases.exchange("nai\u0308ve<image>cafe\u0301 \u0301x", "Une cafe\u0301.", images=[media.file("odd2")])
    return [*cases.qwen_rule_records(media), marks]


def test_sample_tokenizer_equals_the_processor(bundle, media, tmp_path):
    tokenizer = SampleTokenizer(bundle)
    image_id = bundle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, _records(media))
    for record in _records(media):
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the assistant replies and their <|im_end|>\n, nothing else
        # (the tokenizer's NFC normalizer composes the combining marks)
        expected = unicodedata.normalize("NFC", "".join(r + "<|im_end|>\n" for r in cases.replies(record)))
        cases.assert_loss_mask(bundle, sample, expected, {image_id})


def test_aspect_over_200_is_an_error_like_the_processor(bundle, media, tmp_path):
    cases.assert_rejected_like_processor(bundle, tmp_path, media, REJECTED, match="aspect ratio")


def test_stage_stores_the_processor_ids(q35_dir, bundle, media, tmp_path):
    """``prep tokenize`` on a small dataset, every sample verified by the stage too."""
    bad = cases.exchange("<image>x", "y", images=[media.file(REJECTED)])
    records = [r for r in _records(media) if media.file("huge") not in r["images"]][-4:] + [bad]
    run = cases.run_stage(tmp_path, q35_dir, media.root, records)
    assert [e["reason"] for e in run.errors] == ["processor_rejected"]
    assert len(run.rows) == len(records) - 1 and run.manifest.verify.checked == len(run.rows)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(bundle, conv)


def test_property_grid_equals_the_image_processor(bundle):
    """500 random (width, height): the grid and token count equal the real image processor's."""
    counter = Qwen3VLCounter.from_processor(bundle)
    cases.assert_qwen_grid_equals_image_processor(
        bundle, counter, cases.qwen_rule_sizes(random.Random("qwen3_5"), 500, [32])
    )
