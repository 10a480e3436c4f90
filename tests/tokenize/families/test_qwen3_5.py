"""Qwen3.5: the Qwen3-VL counter against the real ``Qwen3VLProcessor`` with Qwen3.5 settings.

transformers 5.23 serves Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) with ``Qwen3VLProcessor`` +
``Qwen2VLImageProcessorPil`` + ``Qwen3_5Tokenizer``; the processor class name is Qwen3-VL's, so
:class:`prep.tokenize.families.qwen3_vl.Qwen3VLCounter` serves it. The processor directory is
:mod:`prep.example.families.qwen3_5`'s (``prep example --family qwen3_5``): Qwen/Qwen3.5-27B's
processor and tokenizer classes and vision settings (patch 16, merge 2, from
``configuration_qwen3_5``), Qwen3-VL's pixel limits (65536..16777216) and chat template (the
Qwen3.5 checkpoint files could not be read offline). The Qwen3.5 tokenizer's own pre-tokenizer
(combining marks kept with letters) is exercised by text touching the image tag.

Oracle: the real processor's ``apply_chat_template(..., tokenize=True)`` on image paths, and
its image processor's ``image_grid_thw`` / ``pixel_values`` for 500 random sizes.
"""

from __future__ import annotations

import json
import math
import random
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prep.example.families.qwen3_5 import build_processor_dir
from prep.example.media import make_image_bytes
from prep.run import LOCAL
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaRejected, find_counter
from prep.tokenize.families.qwen3_vl import Qwen3VLCounter
from prep.tokenize.processor import ProcessorBundle, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part


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
    assert (counter.image.patch_size, counter.image.merge_size) == (16, 2)
    assert (counter.image.min_pixels, counter.image.max_pixels) == (65536, 16777216)
    assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merged = bundle.processor._merge_kwargs(bundle.processor.valid_processor_kwargs)["images_kwargs"]
    assert not {"size", "min_pixels", "max_pixels", "patch_size", "merge_size"} & set(merged)


# name -> (width, height, mode, format, EXIF orientation)
IMAGES = {
    "tiny1": (1, 1, "RGB", "PNG", None),
    "tiny10": (10, 10, "RGB", "JPEG", None),
    "wide": (3000, 16, "RGB", "PNG", None),
    "tall": (16, 3000, "RGB", "PNG", None),
    "odd": (333, 517, "RGB", "JPEG", None),
    "odd2": (1537, 29, "RGB", "JPEG", None),
    "exif6": (96, 40, "RGB", "JPEG", 6),  # stored 96x40, shown 40x96
    "exif8": (1300, 200, "RGB", "JPEG", 8),
    "rgba": (200, 90, "RGBA", "PNG", None),
    "gray": (70, 130, "L", "PNG", None),
    "ratio200": (4000, 20, "RGB", "PNG", None),  # exactly 200:1: accepted
    "ratio205": (4100, 20, "RGB", "PNG", None),  # > 200:1: smart_resize raises
}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_5_media")
    for name, (width, height, mode, fmt, orientation) in IMAGES.items():
        suffix = "jpg" if fmt == "JPEG" else "png"
        (root / f"{name}.{suffix}").write_bytes(make_image_bytes(width, height, mode, fmt, orientation, seed=width))
    Image.new("RGB", (8000, 6000), (30, 120, 200)).save(root / "huge.jpg", quality=50)
    return root


def _file(media_dir: Path, name: str) -> str:
    return next(p.name for p in media_dir.iterdir() if p.stem == name)


def _records(media_dir: Path) -> list[dict]:
    """ShareGPT records: every accepted image alone, then the combinations the issue asks for."""
    f = lambda name: _file(media_dir, name)  # noqa: E731
    one: list[dict] = [
        {
            "messages": [
                {"role": "user", "content": f"<image>Describe {name}."},
                {"role": "assistant", "content": f"It is {name}."},
            ],
            "images": [f(name)],
        }
        for name in [*IMAGES, "huge"]
        if name != "ratio205"
    ]
    many: list[dict] = [
        {  # several images in one turn, text touching the tag on both sides
            "messages": [
                {"role": "user", "content": "abc<image><image>def<image>ghi"},
                {"role": "assistant", "content": "Three images."},
            ],
            "images": [f("odd"), f("exif6"), f("exif8")],
        },
        {  # combining marks (Qwen3.5's pre-tokenizer keeps them with letters) touching the tag
            "messages": [
                {"role": "user", "content": "nai\u0308ve<image>cafe\u0301 \u0301x"},
                {"role": "assistant", "content": "Une cafe\u0301."},
            ],
            "images": [f("odd2")],
        },
        {  # images in several turns, with a system prompt
            "system": "You are Qwen, a virtual human.",
            "messages": [
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "And here?<image>"},
                {"role": "assistant", "content": "A dog on a red table."},
                {"role": "user", "content": "x<image>y"},
                {"role": "assistant", "content": "The tree."},
            ],
            "images": [f("rgba"), f("gray"), f("tall")],
        },
    ]
    return one + many


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", "utf-8")


def _spec(tmp_path: Path, media_dir: Path, records: list[dict]):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    config = tmp_path / "dataset_info.json"
    _write_json(config, {"q35": {"file_name": str(data), "formatting": "sharegpt", "media_dir": str(media_dir)}})
    return config, load_dataset_config(config)[0]


def _hf_ids(bundle: ProcessorBundle, messages: list[Any], paths: list[str]) -> list[int]:
    """The processor's own template + image loading (from paths, EXIF applied) + expansion."""
    images = iter(paths)
    conversation = [
        {
            "role": m["role"],
            "content": [{"type": "image", "path": next(images)} if c["type"] == "image" else c for c in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]
    assert bundle.processor is not None
    out: Any = bundle.processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


def _shown_size(im: Image.Image) -> tuple[int, int]:
    orientation = im.getexif().get(0x0112, 1)
    return (im.height, im.width) if orientation in (5, 6, 7, 8) else im.size


def test_sample_tokenizer_equals_the_processor(bundle, media_dir, tmp_path):
    tokenizer = SampleTokenizer(bundle)
    image_id = bundle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    _, spec = _spec(tmp_path, media_dir, _records(media_dir))
    for record in _records(media_dir):
        conv = to_conversation(record, spec)
        sample = tokenizer.tokenize(conv, VideoSampling())
        expected = _hf_ids(bundle, conv.messages, [item.ref.path for item in conv.media])
        assert sample.input_ids == expected, record["images"]
        # loss mask: exactly the assistant replies and their <|im_end|>\n, nothing else
        learned = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        # (the tokenizer's NFC normalizer composes the combining marks)
        assert bundle.tokenizer.decode(learned) == unicodedata.normalize(
            "NFC", "".join(r + "<|im_end|>\n" for r in replies)
        )
        assert not any(m for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t == image_id)
        for (_, count), item in zip(sample.media, conv.media, strict=True):
            with Image.open(item.ref.path) as im:
                assert (count.width, count.height) == _shown_size(im)


def test_aspect_over_200_is_an_error_like_the_processor(bundle, media_dir, tmp_path):
    record = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": [_file(media_dir, "ratio205")],
    }
    _, spec = _spec(tmp_path, media_dir, [record])
    conv = to_conversation(record, spec)
    with pytest.raises(ValueError, match="aspect ratio"):
        _hf_ids(bundle, conv.messages, [conv.media[0].ref.path])
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


def test_stage_stores_the_processor_ids(q35_dir, bundle, media_dir, tmp_path):
    """``prep tokenize`` on a small dataset, every sample verified by the stage too."""
    bad = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": [_file(media_dir, "ratio205")],
    }
    records = [r for r in _records(media_dir) if _file(media_dir, "huge") not in r["images"]][-4:] + [bad]
    config, spec = _spec(tmp_path, media_dir, records)
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(q35_dir),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    assert [e["reason"] for e in _table(out, ERRORS_DIR).to_pylist()] == ["processor_rejected"]
    rows = _table(out, SAMPLES_DIR).to_pylist()
    assert len(rows) == len(records) - 1 and manifest.verify.checked == len(rows)
    for row in rows:
        conv = to_conversation(records[row["line"]], spec)
        assert row["input_ids"] == _hf_ids(bundle, conv.messages, [i.ref.path for i in conv.media])


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..1200, sides near multiples of 32, and ratios near 200:1."""
    sizes = []
    for _ in range(n):
        w, h = (max(1, int(math.exp(rng.uniform(0, math.log(1200))))) for _ in range(2))
        pick = rng.random()
        if pick < 0.15:
            w = 32 * rng.randint(1, 30) + rng.choice([-1, 0, 1])
        elif pick < 0.25:
            h = rng.randint(1, 6)
            w = h * 200 + rng.choice([-1, 0, 1, 2])
        sizes.append((w, h) if rng.random() < 0.5 else (h, w))
    return sizes


def test_property_grid_equals_the_image_processor(bundle):
    """500 random (width, height): the grid and token count equal the real image processor's."""
    counter = Qwen3VLCounter.from_processor(bundle)
    for width, height in _property_sizes(random.Random("qwen3_5"), 500):
        image = Image.new("RGB", (width, height))
        try:
            out = bundle.image_processor(images=[image], return_tensors="np")
        except ValueError:
            with pytest.raises(MediaRejected):
                counter.count_image(width, height)
            continue
        count = counter.count_image(width, height)
        assert [int(v) for v in out["image_grid_thw"][0]] == [count.grid_t, count.grid_h, count.grid_w], (width, height)
        assert out["pixel_values"].shape[0] == count.num_tokens * counter.image.merge_size**2
        assert count.expansion == (counter.image_token_id,) * count.num_tokens
