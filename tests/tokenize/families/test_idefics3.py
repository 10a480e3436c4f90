"""Idefics3 / SmolVLM / SmolVLM2: the closed form against the real processors, built offline.

Processor directories come from :mod:`prep.example.families.idefics3` (a small byte-level BPE
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

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import transformers.models.smolvlm.processing_smolvlm as smolvlm_processing
from PIL import Image
from transformers import ProcessorMixin

from prep.example.families.base import example_family
from prep.example.families.idefics3 import build_idefics3_dir
from prep.run import LOCAL
from prep.sources.conversation import Conversation, MediaItem
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import find_counter
from prep.tokenize.families.idefics3 import Idefics3Counter
from prep.tokenize.processor import ProcessorBundle, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import VideoSampling
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.media_ref import MediaRef
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part

CHECKPOINTS = ("idefics3", "smolvlm", "smolvlm2")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("idefics3")
    out = {name: build_idefics3_dir(root / name, name) for name in CHECKPOINTS}
    # a grid past the vocabulary's <row_6_col_6>: rows 7, 8 are written as text and BPE-tokenized
    out["big_grid"] = build_idefics3_dir(root / "big_grid", "smolvlm")
    _edit_json(
        out["big_grid"] / "preprocessor_config.json", size={"longest_edge": 1024}, max_image_size={"longest_edge": 128}
    )
    out["no_split"] = build_idefics3_dir(root / "no_split", "smolvlm2")
    _edit_json(out["no_split"] / "preprocessor_config.json", do_image_splitting=False)
    out["no_resize"] = build_idefics3_dir(root / "no_resize", "idefics3")
    _edit_json(out["no_resize"] / "preprocessor_config.json", do_resize=False)
    return out


def _edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text("utf-8")), **changes}), "utf-8")


@pytest.fixture(scope="module")
def bundles(dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    with pytest.MonkeyPatch.context() as mp:
        if smolvlm_processing.num2words is None:  # video-only dependency of SmolVLMProcessor.__init__
            mp.setattr(smolvlm_processing, "num2words", str)
        loaded = {name: load_processor(str(path)) for name, path in dirs.items()}
    for bundle in loaded.values():
        assert bundle.processor is not None, bundle.source
    return loaded


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("idefics3_images")
    rng = np.random.default_rng(0)

    def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
        return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)

    out: dict[str, Path] = {}
    for name, (w, h) in {
        "tiny1": (1, 1),
        "tiny10": (10, 10),
        "wide": (3000, 16),
        "tall": (16, 3000),
        "extreme": (4100, 20),  # > 200:1
        "odd": (333, 517),
        "odd2": (1023, 767),
        "one_px_past": (365, 729),  # sides one pixel past tile multiples
        "small": (300, 200),  # one tile without resizing
    }.items():
        out[name] = root / f"{name}.png"
        noise(w, h).save(out[name])
    out["huge"] = root / "huge.jpg"
    Image.new("RGB", (8000, 6000), (10, 200, 30)).save(out["huge"], quality=50)
    out["exif"] = root / "exif.jpg"  # stored 900x200, orientation 6: shown 200x900
    exif = Image.Exif()
    exif[0x0112] = 6
    noise(900, 200).save(out["exif"], exif=exif.tobytes())
    out["rgba"] = root / "rgba.png"
    noise(500, 300, "RGBA").save(out["rgba"])
    out["gray"] = root / "gray.png"
    noise(700, 350, "L").save(out["gray"])
    return out


def _conv(turns: list[tuple[str, list[str | Path]]]) -> tuple[Conversation, list[dict[str, Any]]]:
    """Turns of (role, parts): a Path part is an image. Returns ours and the processor's messages."""
    messages: list[dict[str, Any]] = []
    hf: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for role, parts in turns:
        content: list[dict[str, str]] = []
        hf_content: list[dict[str, str]] = []
        for part in parts:
            if isinstance(part, Path):
                content.append({"type": "image"})
                hf_content.append({"type": "image", "path": str(part)})
                media.append(MediaItem(kind="image", ref=MediaRef(path=str(part))))
            else:
                content.append({"type": "text", "text": part})
                hf_content.append({"type": "text", "text": part})
        messages.append({"role": role, "content": content})
        hf.append({"role": role, "content": hf_content})
    return Conversation(messages=messages, media=media), hf


def _processor_ids(bundle: ProcessorBundle, hf_messages: list[dict[str, Any]]) -> list[int]:
    out = ProcessorMixin.apply_chat_template(bundle.processor, hf_messages, tokenize=True, return_dict=True)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


SINGLE = ["tiny1", "tiny10", "wide", "tall", "extreme", "odd", "odd2", "one_px_past", "huge", "exif", "rgba", "gray"]


@pytest.mark.parametrize(
    ("checkpoint", "name"),
    [("idefics3", name) for name in SINGLE] + [("smolvlm2", name) for name in SINGLE if name != "huge"],
)
def test_single_image_equals_processor(bundles, images, checkpoint, name):
    bundle = bundles[checkpoint]
    conv, hf = _conv([("user", [images[name], "Describe it."]), ("assistant", ["A picture."])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, hf)
    (_, count), *_ = sample.media
    assert count.num_tiles == (count.grid_h * count.grid_w + 1 if count.grid_h else 1)


@pytest.mark.parametrize("checkpoint", ["big_grid", "no_split", "no_resize"])
@pytest.mark.parametrize("name", ["tiny10", "odd2", "small", "exif"])
def test_other_settings_equal_processor(bundles, images, checkpoint, name):
    """Rows past the vocabulary's row/col tokens, no splitting (single prompt), no resizing."""
    bundle = bundles[checkpoint]
    conv, hf = _conv([("user", ["x", images[name], "y"]), ("assistant", ["z"])])
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, hf)


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
    conv, hf = _conv(
        [
            ("system", ["You are helpful."]),
            ("user", ["abc", images["odd"], images["wide"], "\n\nxyz", images["gray"], "end\n"]),
            ("assistant", ["First answer."]),
            ("user", [images["exif"], "again?", images["tiny1"]]),
            ("assistant", ["Second", " answer."]),
            ("user", ["no image here"]),
            ("assistant", ["Third."]),
        ]
    )
    sample = SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert sample.input_ids == _processor_ids(bundle, hf)
    assert [c.kind for _, c in sample.media] == ["image"] * 5
    learned = bundle.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learned == " First answer.<end_of_utterance>\n Second answer.<end_of_utterance>\n Third.<end_of_utterance>\n"
    image_id = bundle.tokenizer.convert_tokens_to_ids("<image>")
    ignored = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    assert ignored.count(image_id) == sum(c.num_tokens for _, c in sample.media)


def test_id_splice_equals_text_level_expansion(bundles, images):
    """The ids path equals expanding the text first (the processor's own order), item for item."""
    bundle = bundles["smolvlm"]
    conv, _ = _conv([("user", ["a ", images["odd"], " \n", images["tall"], "\n\n"]), ("assistant", ["ok"])])
    by_ids = SampleTokenizer(bundle)
    assert isinstance(by_ids.counter, Idefics3Counter) and not by_ids.counter.text_level
    by_text = SampleTokenizer(bundle)
    by_text.counter = replace(by_ids.counter, text_level=True)
    a, b = by_ids.tokenize(conv, VideoSampling()), by_text.tokenize(conv, VideoSampling())
    assert a.input_ids == b.input_ids and np.array_equal(a.loss_mask, b.loss_mask)


def test_video_sample_is_a_clear_error_row(bundles, tmp_path):
    conv = Conversation(
        messages=[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        media=[MediaItem(kind="video", ref=MediaRef(path=str(tmp_path / "clip.mp4")))],
    )
    bundle = bundles["smolvlm2"]
    if getattr(bundle.processor, "video_processor", None) is not None:
        pytest.skip("torchvision present: video runs the real processor")
    with pytest.raises(SampleError) as info:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert info.value.reason == Reason.PROCESSOR_REJECTED


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


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


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
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    config = tmp_path / "dataset_info.json"
    config.write_text(json.dumps({"smol": {"file_name": str(data), "formatting": "sharegpt"}}), "utf-8")
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(dirs["smolvlm2"]),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    rows = _table(out, SAMPLES_DIR).to_pylist()
    assert len(rows) == 3 and manifest.verify.checked == 3
    errors = _table(out, ERRORS_DIR).to_pylist()
    assert [e["reason"] for e in errors] in (["processor_rejected"], ["missing_media"])
    bundle = bundles["smolvlm2"]
    for row in rows:
        record = records[row["line"]]
        paths = iter(record["images"])
        hf = [
            {
                "role": m["role"],
                "content": [{**c, "path": next(paths)} if c["type"] == "image" else c for c in m["content"]],
            }
            for m in record["messages"]
        ]
        assert row["input_ids"] == _processor_ids(bundle, hf)


@pytest.mark.parametrize("name", ["idefics3", "smolvlm"])
def test_example_family_is_registered(tmp_path, name):
    family = example_family(name)
    built = family.build_processor(tmp_path / name)
    assert (built / "processor_config.json").exists() and name in family.name
