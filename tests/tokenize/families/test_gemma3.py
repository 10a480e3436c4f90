"""Gemma 3: the closed form against the real ``Gemma3Processor`` + ``Gemma3ImageProcessorPil``.

The processor directory is :func:`families.gemma3.example.build_gemma3_processor_dir`:
settings of google/gemma-3-4b-it (896 x 896, ``image_seq_length`` 256, its chat template
verbatim from its ``tokenizer_config.json``), a small BPE loaded by transformers'
``GemmaTokenizer`` (merges cross newlines, so ``"\\n\\n"`` joins its neighbours as in the real
vocabulary) with Gemma's special tokens. Pan-and-scan is tested off (the checkpoint's default:
``Gemma3Processor.images_kwargs`` forces False) and on (the processor instance's
``images_kwargs`` turned on, which ``_merge_kwargs`` passes to every call, as a user would).

Oracle: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (it
decodes and EXIF-transposes them itself) and, for crop counts, the image processor's own
``pan_and_scan``; compared with what ``SampleTokenizer`` and the ``prep tokenize`` stage store.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from families.counter import image_attention
from families.gemma3.counter import Gemma3Counter
from families.gemma3.example import BOI, EOI, IMAGE_SOFT, build_gemma3_processor_dir
from families.processor import ProcessorBundle, load_processor
from families.registry import find_counter
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from tests.tokenize.families import cases

MODES = ("pan_and_scan_off", "pan_and_scan_on")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_processor_dir(tmp_path_factory.mktemp("gemma3") / "processor")


@pytest.fixture(scope="module")
def bundles(gemma_dir: Path) -> dict[str, ProcessorBundle]:
    """Two loads of the same directory; the second with pan-and-scan on through the processor's kwargs."""
    off, on = load_processor(str(gemma_dir)), load_processor(str(gemma_dir))
    assert on.processor is not None
    processor: Any = on.processor  # images_kwargs is a TypedDict without Gemma's keys
    processor.images_kwargs = {**type(processor).images_kwargs, "do_pan_and_scan": True}
    return {"pan_and_scan_off": off, "pan_and_scan_on": on}


def _ids(bundle: ProcessorBundle, *tokens: str) -> list[int]:
    return [int(i) for i in bundle.tokenizer.convert_tokens_to_ids(list(tokens))]


def test_load_processor_builds_the_real_processor_on_cpu(bundles):
    off, on = bundles["pan_and_scan_off"], bundles["pan_and_scan_on"]
    assert off.processor_class == "Gemma3Processor" and type(off.processor).__name__ == "Gemma3Processor"
    assert type(off.image_processor).__name__ == "Gemma3ImageProcessorPil"
    counter = find_counter("Gemma3Processor")(off)
    assert isinstance(counter, Gemma3Counter)
    assert counter.image_token_id == off.processor.image_token_id == _ids(off, BOI)[0]
    assert counter.settings.image_seq_length == off.processor.image_seq_length == 256
    assert counter.full_image_sequence == off.processor.full_image_sequence
    assert image_attention(counter) == "bidirectional"
    # the file says null, the processor class says False / 256 / 4 / 1.2
    assert off.image_processor.do_pan_and_scan is None and counter.settings.pan_and_scan is None
    pas = Gemma3Counter.from_processor(on).settings.pan_and_scan
    assert pas is not None and (pas.min_crop_size, pas.max_num_crops, pas.min_ratio_to_activate) == (256, 4, 1.2)


def test_the_file_cannot_turn_pan_and_scan_on(gemma_dir, tmp_path):
    """``do_pan_and_scan: true`` in preprocessor_config.json: the processor still passes False, and so do we."""
    shutil.copytree(gemma_dir, tmp_path / "p")
    cases.edit_json(tmp_path / "p" / "preprocessor_config.json", do_pan_and_scan=True)
    bundle = load_processor(str(tmp_path / "p"))
    assert bundle.processor is not None and bundle.image_processor.do_pan_and_scan is True
    counter = Gemma3Counter.from_processor(bundle)
    out = bundle.processor(text=[f"a{BOI}"], images=[Image.new("RGB", (1200, 400))], return_tensors="np")
    assert (
        counter.settings.pan_and_scan is None
        and out["pixel_values"].shape[0] == counter.count_image(1200, 400).num_tiles == 1
    )


def test_the_bpe_merge_trap_is_real_in_this_vocabulary(bundles):
    """Splicing the expansion as ids would differ: ``"\\n\\n"`` merges with the text around it."""
    tok = bundles["pan_and_scan_off"].tokenizer
    for left, right in (("abc", "\n\n"), ("Look:", "\n\n"), ("\n\n", "def"), ("\n", "\n\n")):
        joined = tok(left + right, add_special_tokens=False)["input_ids"]
        apart = tok(left, add_special_tokens=False)["input_ids"] + tok(right, add_special_tokens=False)["input_ids"]
        assert joined != apart, (left, right)


# odd: portrait 1.55, 2 crops of 333x259; huge: 2 crops when on
IMAGES = {
    **cases.STANDARD_IMAGES,
    "exif6": (900, 300, "RGB", "JPEG", 6),  # stored 900x300, shown 300x900: 3 crops in a column
    "exif8": (96, 40, "RGB", "JPEG", 8),
    "rgba": (700, 280, "RGBA", "PNG", None),  # 2.5:1 -> 3 crops (half rounds up)
    "pas3": (1200, 400, "RGB", "JPEG", None),  # 3 crops
    "pas4": (300, 1100, "RGB", "PNG", None),  # 4 crops of 300x275
}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    return cases.write_images(tmp_path_factory.mktemp("gemma3_media"), IMAGES, video=True)


def _records(media: cases.MediaFiles) -> list[dict]:
    """ShareGPT records: every image alone, then the combinations the issue asks for."""
    f = media.file
    one = cases.one_image_records(media, [*IMAGES, "huge"])
    many = [
        cases.three_images_one_turn([f("odd"), f("exif6"), f("huge")]),
        # a system prompt (the first user turn's prefix)
        cases.images_in_three_turns([f("rgba"), f("gray"), f("pas4")], system_turn="Look:"),
        cases.same_image_twice([f("tiny1"), f("ratio205"), f("tiny1")]),  # and the 1x1 beside the 205:1
    ]
    return one + many


@pytest.mark.parametrize("mode", MODES)
def test_sample_tokenizer_equals_the_processor(bundles, media, tmp_path, mode):
    bundle = bundles[mode]
    tokenizer = SampleTokenizer(bundle)
    boi, eoi, soft = _ids(bundle, BOI, EOI, IMAGE_SOFT)
    records = _records(media)
    _, spec = cases.sharegpt_dataset(tmp_path, media.root, records)
    tiles = []
    for record in records:
        sample = cases.assert_ids_equal_processor(tokenizer, to_conversation(record, spec), record["images"])
        # loss mask: exactly the replies and their <end_of_turn>\n (no {% generation %} in the template)
        cases.assert_loss_mask(
            bundle, sample, "".join(r + "<end_of_turn>\n" for r in cases.replies(record)), (boi, eoi, soft)
        )
        assert sample.input_ids.count(soft) == sum(c.num_tokens for _, c in sample.media)
        assert sample.input_ids.count(boi) == sum(c.num_tiles for _, c in sample.media)
        tiles.extend(count.num_tiles for _, count in sample.media)
    if mode == "pan_and_scan_off":
        assert set(tiles) == {1}
    else:  # the set exercises 0, 2, 3 and 4 crops
        assert {1, 3, 4, 5} <= set(tiles)


def test_video_is_an_unsupported_media_error(bundles):
    err = cases.assert_video_unsupported(find_counter("Gemma3Processor")(bundles["pan_and_scan_off"]))
    assert "no video" in str(err)


def test_stage_stores_the_processor_ids_and_error_rows(gemma_dir, bundles, media, tmp_path):
    """``prep tokenize`` on a small dataset, every sample verified by the stage against the processor too."""
    records = _records(media)[-3:] + [cases.exchange("<video>x", "y", videos=[cases.VIDEO])]
    run = cases.run_stage(tmp_path, gemma_dir, media.root, records)
    assert [e["reason"] for e in run.errors] == ["unsupported_media"]
    assert len(run.rows) == len(records) - 1 and run.manifest.verify.checked == len(run.rows)
    assert run.manifest.processor.image_attention == "bidirectional"  # train refuses causal packing of it
    for row, conv in run.conversations(records):
        assert row["input_ids"] == cases.conversation_ids(bundles["pan_and_scan_off"], conv)
        assert [(m["num_tiles"], m["num_tokens"]) for m in row["media"]] == [(1, 256)] * len(conv.media)


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..4000, plus the rule's edges: ratios near 1.2 and n + 0.5, sides near k x 256."""
    sizes = []
    for _ in range(n):
        w, h = cases.log_uniform_pair(rng, 4000)
        pick = rng.random()
        if pick < 0.15:  # aspect ratio at / around the activation threshold
            h = rng.randint(1, 2000)
            w = max(1, round(h * 1.2) + rng.choice([-1, 0, 0, 1]))
        elif pick < 0.3:  # aspect ratio at / around n + 0.5 (half rounds up)
            h = rng.randint(100, 1200)
            w = max(1, round(h * rng.choice([1.5, 2.5, 3.5, 4.5])) + rng.choice([-1, 0, 0, 1]))
        elif pick < 0.45:  # long side near a multiple of the minimum crop
            w = 256 * rng.randint(1, 6) + rng.choice([-1, 0, 1])
            h = rng.randint(200, 600)
        sizes.append(cases.maybe_swapped(rng, w, h))
    return sizes


def test_property_crops_equal_the_image_processor(bundles):
    """500 random (width, height): our crop grid equals ``Gemma3ImageProcessorPil.pan_and_scan``'s crops."""
    bundle = bundles["pan_and_scan_on"]
    counter = Gemma3Counter.from_processor(bundle)
    pas = counter.settings.pan_and_scan
    assert pas is not None
    ip = bundle.image_processor
    seen = set()
    for width, height in _property_sizes(random.Random("gemma3-pan-and-scan"), 500):
        crops = ip.pan_and_scan(
            image=np.zeros((3, height, width), dtype=np.uint8),
            pan_and_scan_min_crop_size=pas.min_crop_size,
            pan_and_scan_max_num_crops=pas.max_num_crops,
            pan_and_scan_min_ratio_to_activate=pas.min_ratio_to_activate,
        )
        rows, cols = counter.crop_grid(width, height)
        assert rows * cols == len(crops), (width, height)
        if crops:  # the grid's shape too: one row of crops for landscape, one column for portrait
            assert (rows == 1) == (width >= height) and (crops[0].shape[1], crops[0].shape[2]) == (
                math.ceil(height / rows),
                math.ceil(width / cols),
            )
        seen.add(len(crops))
    assert seen == {0, 2, 3, 4}


@pytest.mark.parametrize("mode", MODES)
def test_property_processor_call_equals_the_expansion(bundles, mode):
    """40 random sizes through the whole processor call: tiles and the expanded ids equal ours."""
    bundle = bundles[mode]
    assert bundle.processor is not None
    counter = Gemma3Counter.from_processor(bundle)
    tok = bundle.tokenizer
    for width, height in _property_sizes(random.Random(f"gemma3-call-{mode}"), 40):
        text = f"a{BOI}b"
        out = bundle.processor(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="np")
        count = counter.count_image(width, height)
        assert out["pixel_values"].shape[0] == count.num_tiles, (width, height)
        assert count.expansion_text is not None
        ours = tok("a" + count.expansion_text + "b")["input_ids"]
        assert list(out["input_ids"][0]) == ours, (width, height)
