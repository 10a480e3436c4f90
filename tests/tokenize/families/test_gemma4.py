"""Gemma 4: the closed form against the real ``Gemma4Processor`` + ``Gemma4ImageProcessorPil``.

The processor directory is :func:`families.gemma4.example.build_gemma4_processor_dir`: image
settings of google/gemma-4-31B-it (``max_soft_tokens`` 280, patch 16, pooling 3), its chat
template (tool parts left out), a small BPE loaded by transformers' ``GemmaTokenizer`` with
Gemma 4's special tokens. Every budget the image processor accepts (70 ... 1120) is checked.

Oracles: the image processor's own ``num_soft_tokens_per_image`` on a dense grid of sizes and
on random ones (tiny, huge, extreme aspect, sides at multiples of 48 px and one off); the
processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* for whole
conversations; the ``prep tokenize`` stage with every sample verified.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from PIL import Image

from families.counter import MediaRejected, image_attention
from families.gemma4.counter import Gemma4Counter
from families.gemma4.example import BOI, EOI, IMAGE_SOFT, build_gemma4_processor_dir
from families.gemma4.settings import SUPPORTED_SOFT_TOKENS
from families.processor import ProcessorBundle, ProcessorLoadError, load_processor
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from tests.tokenize.families import cases


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma4_processor_dir(tmp_path_factory.mktemp("gemma4") / "processor")


@pytest.fixture(scope="module")
def bundle(gemma_dir: Path) -> ProcessorBundle:
    return load_processor(str(gemma_dir))


def _ids(bundle: ProcessorBundle, *tokens: str) -> list[int]:
    return [int(i) for i in bundle.tokenizer.convert_tokens_to_ids(list(tokens))]


def test_load_processor_builds_the_real_processor_on_cpu(bundle):
    assert bundle.processor_class == "Gemma4Processor" and type(bundle.processor).__name__ in (
        "Gemma4Processor",
        "ImageOnly",  # without torchvision: the real class minus its video / audio slots
    )
    assert isinstance(bundle.processor, __import__("transformers").Gemma4Processor)
    assert type(bundle.image_processor).__name__ in ("Gemma4ImageProcessorPil", "Gemma4ImageProcessor")  # torchvision
    counter = find_counter("Gemma4Processor")(bundle)
    assert isinstance(counter, Gemma4Counter)
    assert counter.image_token_id == bundle.processor.image_token_id == _ids(bundle, IMAGE_SOFT)[0]
    assert (counter.boi_token_id, counter.eoi_token_id) == tuple(_ids(bundle, BOI, EOI))
    assert image_attention(counter) == "bidirectional"
    s = counter.settings
    assert (s.max_soft_tokens, s.patch_size, s.pooling_kernel_size) == (280, 16, 3)
    cases.assert_no_processor_image_kwargs(bundle)


def test_settings_the_counter_cannot_count_are_refused(gemma_dir, tmp_path):
    shutil.copytree(gemma_dir, tmp_path / "p")
    cases.edit_json(tmp_path / "p" / "preprocessor_config.json", do_resize=False)
    with pytest.raises(ProcessorLoadError, match="do_resize is false"):
        Gemma4Counter.from_processor(load_processor(str(tmp_path / "p")))


def _dense_sizes() -> list[tuple[int, int]]:
    """Tiny, huge, extreme aspect, and sides at / around multiples of 48 px and the budget's edges."""
    sides = [1, 2, 3, 4, 7, 16, 47, 48, 49, 95, 96, 97, 333, 767, 768, 769, 1008, 1009, 2000, 4099]
    sizes = [(w, h) for w in sides for h in sides]
    return sizes + [
        (40000, 1),
        (1, 40000),
        (13440, 48),
        (48, 13441),
        (100000, 3),
        (10000, 7),
        (7, 10000),
        (10000, 4099),
    ]


def _random_sizes(seed: str, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        w, h = cases.log_uniform_pair(rng, 20000)
        if rng.random() < 0.3:  # sides one off a multiple of 48 px
            w = max(1, 48 * rng.randint(1, 60) + rng.choice([-1, 0, 1]))
        sizes.append(cases.maybe_swapped(rng, w, h))
    return sizes


def _processor_tokens(bundle: ProcessorBundle, width: int, height: int, budget: int) -> int:
    out = bundle.image_processor([Image.new("RGB", (width, height))], max_soft_tokens=budget, return_tensors="np")
    return int(out["num_soft_tokens_per_image"][0])


@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKENS)
def test_soft_tokens_equal_the_image_processor(bundle, budget):
    """A dense grid (at 280) or a sample of it, plus random sizes: grid and count equal the processor's."""
    counter = Gemma4Counter.from_processor(bundle)
    settings = type(counter.settings)(images_kwargs={}, max_soft_tokens=budget, patch_size=16, pooling_kernel_size=3)
    sizes = _dense_sizes() if budget == 280 else _dense_sizes()[::7]
    for width, height in sizes + _random_sizes(f"gemma4-{budget}", 40):
        rows, cols = settings.soft_grid(width, height)
        target_h, target_w = settings.resized(width, height)
        assert rows * cols <= budget and (target_h, target_w) == (48 * rows, 48 * cols)
        assert rows * cols == _processor_tokens(bundle, width, height, budget), (width, height, budget)


IMAGES = {
    **cases.STANDARD_IMAGES,
    "at48": (960, 672, "RGB", "PNG", None),  # resizes to itself: 20 x 14 = 280
    "huge": (5000, 3000, "RGB", "JPEG", None),
}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("gemma4_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    f = media.file
    one = cases.one_image_records(media, list(IMAGES))
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("huge")]),
        cases.images_in_three_turns([f("rgba"), f("gray"), f("tall")], system_turn="Look:"),
        cases.same_image_twice([f("tiny1"), f("ratio205"), f("tiny1")]),
    ]
    return one + many


def test_sample_tokenizer_equals_the_processor(bundle, media, tmp_path):
    tokenizer = SampleTokenizer(bundle)
    boi, eoi, soft = _ids(bundle, BOI, EOI, IMAGE_SOFT)
    records = _records(media)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, records)
    counts = set()
    for record in records:
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the replies and their <turn|>\n (no {% generation %} in the template)
        cases.assert_loss_mask(
            bundle, sample, "".join(r + "<turn|>\n" for r in cases.replies(record)), (boi, eoi, soft)
        )
        assert sample.input_ids.count(soft) == sum(c.num_tokens for _, c in sample.media)
        assert sample.input_ids.count(boi) == sample.input_ids.count(eoi) == len(sample.media)
        counts.update(c.num_tokens for _, c in sample.media)
    assert len(counts) >= 8  # variable resolution: many different counts


def test_thought_channels_are_stripped_and_never_trained(bundle, media, tmp_path):
    """Gemma 4's template drops ``<|channel>...<channel|>`` from model text (``strip_thinking``): the
    stored ids equal the processor's and the mask covers the visible replies and ``<turn|>\\n`` only."""
    record = {
        "messages": [
            {"role": "system", "content": "Look:"},
            {"role": "user", "content": "<image>What is it?"},
            {"role": "assistant", "content": "<|channel>thought\nA small picture.<channel|>A cat."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "<|channel>thought\nCheck.<channel|>Yes."},
        ],
        "images": [media.file("odd")],
    }
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, [record])
    sample = cases.assert_ids_equal_processor(SampleTokenizer(bundle), to_conversation(record, spec))
    cases.assert_loss_mask(bundle, sample, "A cat.<turn|>\nYes.<turn|>\n", _ids(bundle, BOI, EOI, IMAGE_SOFT))
    assert "thought" not in bundle.tokenizer.decode(sample.input_ids)


def test_a_video_shorter_than_the_sampled_frames_is_a_rejected_row(bundle):
    """Video is counted (tests/tokenize/families/test_gemma4_video.py); 8 frames < the 32 the processor samples."""
    with pytest.raises(MediaRejected, match="samples 32 frames"):
        find_counter("Gemma4Processor")(bundle).count_video(
            VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling()
        )


def test_stage_stores_the_processor_ids_and_error_rows(gemma_dir, bundle, media, tmp_path):
    """``prep tokenize`` on a small dataset, every sample verified by the stage against the processor too."""
    records = _records(media)[-3:] + [cases.exchange("<video>x", "y", videos=[cases.VIDEO])]
    run = cases.run_stage(tmp_path, gemma_dir, media.root, records)
    assert [e["reason"] for e in run.errors] == ["processor_rejected"]  # the 8-frame clip: 32 frames sampled
    assert len(run.rows) == len(records) - 1 and run.manifest.verify.checked == len(run.rows)
    assert run.manifest.processor.image_attention == "bidirectional"
    counter = Gemma4Counter.from_processor(bundle)
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(bundle, conv)
        sizes = [cases.shown_size(item.ref.path) for item in conv.media]
        assert [m["num_tokens"] for m in row["media"]] == [counter.count_image(*s).num_tokens for s in sizes]
