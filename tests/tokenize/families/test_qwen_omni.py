"""Qwen2.5-Omni / Qwen3-Omni images: the closed form against the real Omni processors.

Processor directories come from :mod:`prep.example.families.qwen_omni` (the ``prep example
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

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from transformers.utils import is_torchvision_available

from prep.example.families.qwen_omni import CHECKPOINTS, build_processor_dir
from prep.example.media import make_image_bytes, write_video
from prep.run import LOCAL
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaRejected, find_counter
from prep.tokenize.families.qwen_omni import QwenOmniCounter
from prep.tokenize.processor import ProcessorBundle, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part

FAMILIES = list(CHECKPOINTS)  # qwen2_5_omni, qwen3_omni_moe


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("omni")
    return {name: build_processor_dir(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="module")
def omni_bundles(omni_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return {name: load_processor(str(path)) for name, path in omni_dirs.items()}


def test_load_processor_builds_the_real_processor_on_cpu(omni_bundles):
    for name, bundle in omni_bundles.items():
        spec = CHECKPOINTS[name]
        assert bundle.processor_class == spec.processor_class
        assert bundle.processor is not None, "real Omni processor not built (verification would be off)"
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, QwenOmniCounter) and not counter.counts_video
        assert (counter.image.patch_size, counter.image.merge_size) == (spec.patch_size, 2)
        assert (counter.image.min_pixels, counter.image.max_pixels) == (3136, 12845056)
        image_token = spec.named["image_token"]
        assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids(image_token)
        assert bundle.processor.image_token == image_token
        # the processor adds no images_kwargs of its own: the image processor's settings rule
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
    root = tmp_path_factory.mktemp("omni_media")
    for name, (width, height, mode, fmt, orientation) in IMAGES.items():
        suffix = "jpg" if fmt == "JPEG" else "png"
        (root / f"{name}.{suffix}").write_bytes(make_image_bytes(width, height, mode, fmt, orientation, seed=width))
    Image.new("RGB", (8000, 6000), (30, 120, 200)).save(root / "huge.jpg", quality=50)
    write_video(root / "clip.mp4", 8, 4.0, 64, 48)
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
    _write_json(config, {"omni": {"file_name": str(data), "formatting": "sharegpt", "media_dir": str(media_dir)}})
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


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_tokenizer_equals_the_processor(omni_bundles, media_dir, tmp_path, family):
    bundle = omni_bundles[family]
    tokenizer = SampleTokenizer(bundle)
    image_id = tokenizer.counter.image_token_id if tokenizer.counter else -1
    _, spec = _spec(tmp_path, media_dir, _records(media_dir))
    for record in _records(media_dir):
        conv = to_conversation(record, spec)
        sample = tokenizer.tokenize(conv, VideoSampling())
        expected = _hf_ids(bundle, conv.messages, [item.ref.path for item in conv.media])
        assert sample.input_ids == expected, record["images"]
        # loss mask: exactly the assistant replies and their <|im_end|>\n, nothing else
        learned = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert bundle.tokenizer.decode(learned) == "".join(r + "<|im_end|>\n" for r in replies)
        assert not any(m for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t == image_id)
        for (_, count), item in zip(sample.media, conv.media, strict=True):
            with Image.open(item.ref.path) as im:
                assert (count.width, count.height) == _shown_size(im)
            assert count.num_tiles == 1 and count.num_tokens == len(count.expansion)


@pytest.mark.parametrize("family", FAMILIES)
def test_aspect_over_200_is_an_error_like_the_processor(omni_bundles, media_dir, tmp_path, family):
    bundle = omni_bundles[family]
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


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_stores_the_processor_ids_and_error_rows(omni_dirs, omni_bundles, media_dir, tmp_path, family):
    """``prep tokenize`` on a small dataset, every sample verified by the stage too."""
    bad = [
        {
            "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
            "images": [_file(media_dir, "ratio205")],
        },
        {
            "messages": [{"role": "user", "content": "<video>x"}, {"role": "assistant", "content": "y"}],
            "videos": ["clip.mp4"],
        },
    ]
    records = [r for r in _records(media_dir) if f"{_file(media_dir, 'huge')}" not in r["images"]][-4:] + bad
    config, spec = _spec(tmp_path, media_dir, records)
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(omni_dirs[family]),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    errors = _table(out, ERRORS_DIR).to_pylist()
    rows = _table(out, SAMPLES_DIR).to_pylist()
    if is_torchvision_available():  # the video is tokenized by the real processor
        assert [e["reason"] for e in errors] == ["processor_rejected"]
    else:  # no closed form for Omni video and no processor to run it: an error row, never a guess
        assert sorted(e["reason"] for e in errors) == ["processor_rejected", "processor_rejected"]
        assert any("video" in e["message"] for e in errors)
        assert len(rows) == len(records) - 2
    assert manifest.verify.checked == len(rows)
    bundle = omni_bundles[family]
    for row in rows:
        conv = to_conversation(records[row["line"]], spec)
        if all(item.kind == "image" for item in conv.media):
            assert row["input_ids"] == _hf_ids(bundle, conv.messages, [i.ref.path for i in conv.media])


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..1200, sides near multiples of the factor, and ratios near 200:1."""
    sizes = []
    for _ in range(n):
        w, h = (max(1, int(math.exp(rng.uniform(0, math.log(1200))))) for _ in range(2))
        pick = rng.random()
        if pick < 0.15:
            w = rng.choice([14, 16, 28, 32]) * rng.randint(1, 30) + rng.choice([-1, 0, 1])
        elif pick < 0.25:
            h = rng.randint(1, 6)
            w = h * 200 + rng.choice([-1, 0, 1, 2])
        sizes.append((w, h) if rng.random() < 0.5 else (h, w))
    return sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_property_grid_equals_the_image_processor(omni_bundles, family):
    """500 random (width, height): the grid and token count equal the real image processor's."""
    bundle = omni_bundles[family]
    counter = QwenOmniCounter.from_processor(bundle)
    for width, height in _property_sizes(random.Random(f"omni-{family}"), 500):
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
