"""Pixtral / Mistral 3 / Ministral 3: the closed form against the real ``PixtralProcessor``.

Two processor directories are built offline by :mod:`prep.example.families.pixtral` (``prep example
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

import json
import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prep.example.families.pixtral import CHECKPOINTS, build_processor_dir
from prep.example.media import make_image_bytes, write_video
from prep.run import LOCAL
from prep.sources.formats.sharegpt import to_conversation
from prep.sources.media import VideoMeta
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaRejected, find_counter
from prep.tokenize.families.pixtral import PixtralCounter
from prep.tokenize.processor import ProcessorBundle, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", "utf-8")


@pytest.fixture(scope="module")
def pixtral_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pixtral")
    return {name: build_processor_dir(root / name, name) for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def pixtral_bundles(pixtral_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return {name: load_processor(str(path)) for name, path in pixtral_dirs.items()}


def test_load_processor_builds_the_real_processor_on_cpu(pixtral_bundles):
    for name, bundle in pixtral_bundles.items():
        patch, merge, longest_edge, _ = CHECKPOINTS[name]
        assert bundle.processor_class == "PixtralProcessor"
        assert bundle.processor is not None, "real PixtralProcessor not built (verification would be off)"
        assert (bundle.processor.patch_size, bundle.processor.spatial_merge_size) == (patch, merge)
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, PixtralCounter)
        assert (counter.patch_size, counter.merge_size, counter.max_height) == (patch, merge, longest_edge)
        assert (counter.image_token_id, counter.image_break_id, counter.image_end_id) == (10, 12, 13)
    a, b = (bundle.identity()["sha256"] for bundle in pixtral_bundles.values())
    assert a != b


# name -> (width, height, mode, format, EXIF orientation)
IMAGES = {
    "tiny1": (1, 1, "RGB", "PNG", None),
    "tiny10": (10, 10, "RGB", "JPEG", None),
    "wide": (3000, 16, "RGB", "PNG", None),
    "tall": (16, 3000, "RGB", "PNG", None),
    "ratio205": (4100, 20, "RGB", "PNG", None),  # > 200:1 (Qwen rejects it; Pixtral does not)
    "odd": (333, 517, "RGB", "JPEG", None),
    "odd2": (1537, 29, "RGB", "JPEG", None),
    "exif6": (96, 40, "RGB", "JPEG", 6),  # stored 96x40, shown 40x96
    "exif8": (1300, 200, "RGB", "JPEG", 8),
    "rgba": (200, 90, "RGBA", "PNG", None),
    "gray": (70, 130, "L", "PNG", None),
    "h1": (1000, 1, "RGB", "PNG", None),  # a 1-pixel side, not floored to 0
    "h3": (40, 3, "RGB", "PNG", None),  # 3 rows: looks like a channel axis to naive code
    "floor0": (3000, 1, "RGB", "PNG", None),  # ratio 2.9 (and 1.9): the short side floors to 0
}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pixtral_media")
    for name, (width, height, mode, fmt, orientation) in IMAGES.items():
        suffix = "jpg" if fmt == "JPEG" else "png"
        (root / f"{name}.{suffix}").write_bytes(make_image_bytes(width, height, mode, fmt, orientation, seed=width))
    Image.new("RGB", (8000, 6000), (30, 120, 200)).save(root / "huge.jpg", quality=50)
    write_video(root / "clip.mp4", 8, 4.0, 64, 48)
    return root


def _file(media_dir: Path, name: str) -> str:
    return next(p.name for p in media_dir.iterdir() if p.stem == name)


def _records(media_dir: Path) -> list[dict]:
    """ShareGPT records: every image alone, then the combinations the issue asks for."""
    f = lambda name: _file(media_dir, name)  # noqa: E731
    one = [
        {
            "messages": [
                {"role": "user", "content": f"<image>Describe {name}."},
                {"role": "assistant", "content": f"It is {name}."},
            ],
            "images": [f(name)],
        }
        for name in [*IMAGES, "huge"]
        if name != "floor0"
    ]
    many = [
        {  # several images in one turn, text touching the tag on both sides
            "messages": [
                {"role": "user", "content": "abc<image><image>def<image>ghi"},
                {"role": "assistant", "content": "Three images."},
            ],
            "images": [f("odd"), f("exif6"), f("huge")],
        },
        {  # images in several turns
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
        {  # the same image twice, and the 1x1 beside the 205:1
            "messages": [
                {"role": "user", "content": "<image>1<image><image>"},
                {"role": "assistant", "content": "Same."},
            ],
            "images": [f("tiny1"), f("ratio205"), f("tiny1")],
        },
    ]
    return one + many


def _spec(tmp_path: Path, media_dir: Path, records: list[dict]):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    config = tmp_path / "dataset_info.json"
    _write_json(config, {"pix": {"file_name": str(data), "formatting": "sharegpt", "media_dir": str(media_dir)}})
    return config, load_dataset_config(config)[0]


def _hf_ids(bundle: ProcessorBundle, messages: list[dict], paths: list[str]) -> list[int]:
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
    out = bundle.processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_sample_tokenizer_equals_the_processor(pixtral_bundles, media_dir, tmp_path, checkpoint):
    bundle = pixtral_bundles[checkpoint]
    tokenizer = SampleTokenizer(bundle)
    _, spec = _spec(tmp_path, media_dir, _records(media_dir))
    for record in _records(media_dir):
        conv = to_conversation(record, spec)
        sample = tokenizer.tokenize(conv, VideoSampling())
        expected = _hf_ids(bundle, conv.messages, [item.ref.path for item in conv.media])
        assert sample.input_ids == expected, record["images"]
        # loss mask: exactly the assistant replies and their </s>, nothing else
        learned = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert bundle.tokenizer.decode(learned) == "".join(r + "</s>" for r in replies)
        assert sample.loss_mask[-1] == 1 and not any(
            m for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t in (10, 12, 13)
        )
        for (_, count), item in zip(sample.media, conv.media, strict=True):
            with Image.open(item.ref.path) as im:
                assert (count.width, count.height) == _shown_size(im)


def _shown_size(im: Image.Image) -> tuple[int, int]:
    orientation = im.getexif().get(0x0112, 1)
    return (im.height, im.width) if orientation in (5, 6, 7, 8) else im.size


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_a_side_flooring_to_zero_is_an_error_like_the_processor(pixtral_bundles, media_dir, tmp_path, checkpoint):
    bundle = pixtral_bundles[checkpoint]
    record = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": [_file(media_dir, "floor0")],
    }
    _, spec = _spec(tmp_path, media_dir, [record])
    conv = to_conversation(record, spec)
    with pytest.raises(ValueError):
        _hf_ids(bundle, conv.messages, [conv.media[0].ref.path])
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED


def test_video_is_an_unsupported_media_error(pixtral_bundles):
    counter = find_counter("PixtralProcessor")(pixtral_bundles["pixtral_12b"])
    with pytest.raises(SampleError) as err:
        counter.count_video(VideoMeta(num_frames=8, fps=4.0, width=64, height=48), VideoSampling())
    assert err.value.reason == Reason.UNSUPPORTED_MEDIA


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


def test_stage_stores_the_processor_ids_and_error_rows(pixtral_dirs, pixtral_bundles, media_dir, tmp_path):
    """``prep tokenize`` on a small dataset (mistral_small_3_1), every sample verified by the stage too."""
    bad = [
        {
            "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
            "images": [_file(media_dir, "floor0")],
        },
        {
            "messages": [{"role": "user", "content": "<video>x"}, {"role": "assistant", "content": "y"}],
            "videos": ["clip.mp4"],
        },
    ]
    records = _records(media_dir) + bad
    config, spec = _spec(tmp_path, media_dir, records)
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(pixtral_dirs["mistral_small_3_1"]),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    errors = _table(out, ERRORS_DIR).to_pylist()
    assert sorted(e["reason"] for e in errors) == ["processor_rejected", "unsupported_media"]
    rows = _table(out, SAMPLES_DIR).to_pylist()
    assert len(rows) == len(records) - 2 and manifest.verify.checked == len(rows)
    bundle = pixtral_bundles["mistral_small_3_1"]
    for row in rows:
        conv = to_conversation(records[row["line"]], spec)
        assert row["input_ids"] == _hf_ids(bundle, conv.messages, [i.ref.path for i in conv.media])


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..5000 plus sides near the longest edge and multiples of the patch."""
    sizes = []
    for _ in range(n):
        w, h = (max(1, int(math.exp(rng.uniform(0, math.log(5000))))) for _ in range(2))
        if rng.random() < 0.2:
            w = rng.choice([1024, 1025, 1540, 1541, 1536, 1008, 28 * rng.randint(1, 60), 16 * rng.randint(1, 70)])
        sizes.append((w, h) if rng.random() < 0.5 else (h, w))
    return sizes


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_property_grid_equals_the_image_processor(pixtral_bundles, checkpoint):
    """500 random (width, height): rows/cols and the [IMG] expansion equal the real processor's."""
    bundle = pixtral_bundles[checkpoint]
    assert bundle.processor is not None
    counter = PixtralCounter.from_processor(bundle)
    patch, merge = counter.patch_size, counter.merge_size
    for width, height in _property_sizes(random.Random(f"pixtral-{checkpoint}"), 500):
        image = Image.new("RGB", (width, height))
        try:
            out = bundle.processor(text=["[IMG]"], images=[image], add_special_tokens=False, return_tensors="np")
        except ValueError:
            with pytest.raises(MediaRejected):
                counter.count_image(width, height)
            continue
        count = counter.count_image(width, height)
        resized_h, resized_w = (int(v) for v in out["image_sizes"][0])
        assert (count.grid_h * patch, count.grid_w * patch) == (resized_h, resized_w), (width, height)
        assert list(out["input_ids"][0]) == list(count.expansion), (width, height)
        assert count.num_tokens == (resized_h // (patch * merge)) * (resized_w // (patch * merge))
