"""Idefics3 / SmolVLM / SmolVLM2: the closed form against the real processors, built offline.

Processor directories come from :mod:`families.idefics3.example` (a small byte-level BPE
with the family's added tokens, the checkpoints' ``User:<image>...<end_of_utterance>`` template):

- ``idefics3``: HuggingFaceM4/Idefics3-8B-Llama3 settings, ``Idefics3Processor`` (longest edge
  1456, tile 364, 169 ``<image>`` per tile; Llama 3 BOS added by the tokenizer);
- ``smolvlm``: HuggingFaceTB/SmolVLM-256M-Instruct settings, ``Idefics3Processor`` (2048 / 512 / 64);
- ``smolvlm2``: HuggingFaceTB/SmolVLM2-2.2B-Instruct settings, ``SmolVLMProcessor`` (1536 / 384 / 81).

Oracle: ``ProcessorMixin.apply_chat_template(..., tokenize=True)`` on image *paths* (the
processor decodes and EXIF-transposes them itself). ``SmolVLMProcessor.__init__`` requires
``num2words`` (used only for video prompts); where it is not installed a stand-in is set so
the real class can be built for images. Its own ``apply_chat_template`` override reads the
video processor (absent without torchvision), so the base ``ProcessorMixin`` one is called.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers.models.smolvlm.processing_smolvlm as smolvlm_processing
from PIL import Image
from transformers import ProcessorMixin

from families.idefics3.counter import Idefics3Counter
from families.idefics3.example import build_idefics3_dir
from families.processor import ProcessorBundle
from families.registry import example_family, find_counter
from prep.sources.conversation import Conversation
from prep.tokenize.core import SampleTokenizer
from schemas.dataset_config import VideoSampling
from tests.tokenize.families import cases

CHECKPOINTS = ("idefics3", "smolvlm", "smolvlm2")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("idefics3")
    out = {name: build_idefics3_dir(root / name, name) for name in CHECKPOINTS}
    # a grid past the vocabulary's <row_6_col_6>: rows 7, 8 are written as text and BPE-tokenized
    out["big_grid"] = build_idefics3_dir(root / "big_grid", "smolvlm")
    cases.edit_json(
        out["big_grid"] / "preprocessor_config.json", size={"longest_edge": 1024}, max_image_size={"longest_edge": 128}
    )
    out["no_split"] = build_idefics3_dir(root / "no_split", "smolvlm2")
    cases.edit_json(out["no_split"] / "preprocessor_config.json", do_image_splitting=False)
    out["no_resize"] = build_idefics3_dir(root / "no_resize", "idefics3")
    cases.edit_json(out["no_resize"] / "preprocessor_config.json", do_resize=False)
    return out


@pytest.fixture(scope="module")
def bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    with pytest.MonkeyPatch.context() as mp:
        if smolvlm_processing.num2words is None:  # video-only dependency of SmolVLMProcessor.__init__
            mp.setattr(smolvlm_processing, "num2words", str)
        loaded = cases.load_bundles(dirs)
    for bundle in loaded.values():
        assert bundle.processor is not None, bundle.source
    return loaded


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> cases.MediaFiles:
    sizes = {
        **cases.NOISE_SIZES,
        "one_px_past": (365, 729),  # sides one pixel past tile multiples
        "small": (300, 200),  # one tile without resizing
    }
    return cases.write_noise_images(tmp_path_factory.mktemp("idefics3_images"), sizes)


def _processor_ids(bundle: ProcessorBundle, conv: Conversation) -> list[int]:
    """The base ``ProcessorMixin.apply_chat_template`` (SmolVLM's override reads the video processor)."""
    return cases.conversation_ids(bundle, conv, apply=ProcessorMixin.apply_chat_template)


SINGLE = ["tiny1", "tiny10", "wide", "tall", "extreme", "odd", "odd2", "one_px_past", "huge", "exif", "rgba", "gray"]


@pytest.mark.parametrize(
    ("checkpoint", "name"),
    [("idefics3", name) for name in SINGLE] + [("smolvlm2", name) for name in SINGLE if name != "huge"],
)
def test_single_image_equals_processor(bundles, images, checkpoint, name):
    bundle = bundles[checkpoint]
    conv = cases.conversation([("user", [images[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, conv)
    (_, count), *_ = sample.media
    assert count.num_tiles == (count.grid_h * count.grid_w + 1 if count.grid_h else 1)


@pytest.mark.parametrize("checkpoint", ["big_grid", "no_split", "no_resize"])
@pytest.mark.parametrize("name", ["tiny10", "odd2", "small", "exif"])
def test_other_settings_equal_processor(bundles, images, checkpoint, name):
    """Rows past the vocabulary's row/col tokens, no splitting (single prompt), no resizing."""
    bundle = bundles[checkpoint]
    conv = cases.conversation([("user", ["x", images[name], "y"]), ("assistant", ["z"])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, conv)


def test_big_grid_writes_row_tags_past_the_vocabulary_as_text(bundles):
    counter = Idefics3Counter.from_processor(bundles["big_grid"])
    assert counter.grid(1023, 767) == (6, 8)
    tokenizer = bundles["big_grid"].tokenizer
    assert tokenizer.convert_tokens_to_ids("<row_6_col_7>") == tokenizer.unk_token_id or (
        "<row_6_col_7>" not in tokenizer.get_vocab()
    )
    assert "<row_6_col_7>" in counter.expansion_text(6, 8)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_many_images_turns_touching_text_and_loss_mask(bundles, images, checkpoint):
    bundle = bundles[checkpoint]
    conv = cases.conversation(cases.images_in_turns(images, "exif", before="\n\n", after="\n"))
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, conv)
    assert [c.kind for _, c in sample.media] == ["image"] * 5
    learned = bundle.tokenizer.decode(cases.learned_ids(sample))
    assert learned == " First answer.<end_of_utterance>\n Second answer.<end_of_utterance>\n Third.<end_of_utterance>\n"
    image_id = bundle.tokenizer.convert_tokens_to_ids("<image>")
    ignored = cases.ignored_ids(sample)
    assert ignored.count(image_id) == sum(c.num_tokens for _, c in sample.media)


def test_id_splice_equals_text_level_expansion(bundles, images):
    """The ids path equals expanding the text first (the processor's own order), item for item."""
    bundle = bundles["smolvlm"]
    conv = cases.conversation([("user", ["a ", images["odd"], " \n", images["tall"], "\n\n"]), ("assistant", ["ok"])])
    by_ids = SampleTokenizer(bundle)
    assert isinstance(by_ids.counter, Idefics3Counter) and not by_ids.counter.text_level
    by_text = SampleTokenizer(bundle)
    by_text.counter = replace(by_ids.counter, text_level=True)
    a, b = by_ids.tokenize(conv, VideoSampling()), by_text.tokenize(conv, VideoSampling())
    assert a.input_ids == b.input_ids and np.array_equal(a.loss_mask, b.loss_mask)


def test_video_sample_is_a_clear_error_row(bundles, tmp_path):
    cases.assert_video_needs_real_processor(bundles["smolvlm2"], cases.video_conversation(tmp_path / "clip.mp4"))


def _random_sizes(rng: random.Random, count: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..2500, a fifth of them one pixel around tile multiples."""
    sizes = []
    for _ in range(count):
        w, h = (max(1, int(2 ** rng.uniform(0, 11.3))) for _ in range(2))
        if rng.random() < 0.2:
            w = rng.choice([364, 384, 512]) * rng.randint(1, 4) + rng.choice([-1, 0, 1])
        sizes.append((w, h))
    return sizes


@pytest.mark.parametrize("checkpoint", ["idefics3", "smolvlm", "smolvlm2", "no_resize"])
def test_grid_equals_the_pil_image_processor_on_random_sizes(bundles, checkpoint):
    """500 sizes per setting: (rows, cols) and tile count equal ``Idefics3ImageProcessorPil``'s."""
    counter = find_counter(bundles[checkpoint].processor_class)(bundles[checkpoint])
    assert isinstance(counter, Idefics3Counter)
    ip = bundles[checkpoint].image_processor
    n = 500 if checkpoint == "idefics3" else 60
    kwargs = {"do_rescale": False, "do_normalize": False, "do_pad": False, "return_row_col_info": True}
    for width, height in _random_sizes(random.Random(checkpoint), n):
        out = ip(images=[[Image.new("RGB", (width, height))]], resample=Image.Resampling.NEAREST, **kwargs)
        count = counter.count_image(width, height)
        assert (count.grid_h, count.grid_w) == (out["rows"][0][0], out["cols"][0][0]), (width, height)
        assert count.num_tiles == len(out["pixel_values"][0]), (width, height)


def test_stage_stores_the_processor_ids(dirs, bundles, images, tmp_path, monkeypatch):
    """``prep tokenize`` (LOCAL) on a small ShareGPT dataset with content lists, all verified."""
    if smolvlm_processing.num2words is None:  # the stage loads the processor itself
        monkeypatch.setattr(smolvlm_processing, "num2words", str)
    media = {name: str(images[name]) for name in ("odd", "exif", "rgba", "tiny1")}

    def turn(role: str, *parts: str) -> dict[str, Any]:
        return {
            "role": role,
            "content": [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts],
        }

    records = [
        {"messages": [turn("user", "<image>", "What?"), turn("assistant", "A cat.")], "images": [media["odd"]]},
        {
            "messages": [turn("user", "x", "<image>", "<image>", "y"), turn("assistant", "Two.")],
            "images": [media["exif"], media["rgba"]],
        },
        {"messages": [turn("user", "<image>"), turn("assistant", "Dot.")], "images": [media["tiny1"]]},
        {"messages": [turn("user", "<video>"), turn("assistant", "Clip.")], "videos": [str(tmp_path / "c.mp4")]},
    ]
    run = cases.run_stage(tmp_path, dirs["smolvlm2"], None, records)
    assert len(run.rows) == 3 and run.manifest.verify.checked == 3
    assert [e["reason"] for e in run.errors] in (["processor_rejected"], ["missing_media"])
    for row in run.rows:
        record = records[row["line"]]
        ids = cases.processor_ids(
            bundles["smolvlm2"], record["messages"], record["images"], apply=ProcessorMixin.apply_chat_template
        )
        assert row["input_ids"] == ids


@pytest.mark.parametrize("name", ["idefics3", "smolvlm"])
def test_example_family_is_registered(tmp_path, name):
    family = example_family(name)
    built = family.build_processor(tmp_path / name)
    assert (built / "processor_config.json").exists() and name in family.name
