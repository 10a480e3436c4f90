"""GLM-4.1V / 4.5V / 4.6V: the closed form against the real ``Glm4vProcessor`` / ``Glm46VProcessor``.

Two processor directories are built offline by :mod:`prep.example.families.glm4v`, each a small
byte-level BPE (GLM-4 split) carrying the GLM special tokens in upstream order and the image
settings patch 14, temporal patch 2, merge 2, pixels 12544..9633792:

- ``glm4_1v``: ``Glm4vProcessor``, zai-org/GLM-4.1V-9B-Thinking (and GLM-4.5V) settings, the
  GLM-4.1V-9B-Thinking chat template verbatim;
- ``glm4_6v``: ``Glm46VProcessor``, zai-org/GLM-4.6V / GLM-OCR settings, GLM-OCR's chat
  template verbatim (the 4.5V/4.6V format with think blocks and tools).

Oracle: the processor's own ``apply_chat_template(..., tokenize=True)`` on image *paths* (it
decodes and EXIF-transposes them itself) and its PIL image processor's ``image_grid_thw``,
compared with what ``SampleTokenizer`` and the ``prep tokenize`` stage store without
decoding a pixel.
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

from prep.example.families.glm4v import GLM_CHECKPOINTS, build_glm4v_dir
from prep.example.media import make_image_bytes, write_video
from prep.run import LOCAL
from prep.sources.formats.sharegpt import to_conversation
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.errors import SampleError
from prep.tokenize.families.base import MediaRejected, find_counter
from prep.tokenize.families.glm4v import Glm4vCounter
from prep.tokenize.processor import ProcessorBundle, ProcessorLoadError, load_processor
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.dataset_config import VideoSampling, load_dataset_config
from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from schemas.reasons import Reason
from schemas.tokenized import list_parts, open_part

PROCESSOR_CLASS = {name: classes[0] for name, classes in GLM_CHECKPOINTS.items()}
# What each template renders before an assistant reply, inside the reply's turn (the 4.5V/4.6V
# format writes an empty think block for a reply without reasoning).
REPLY_PREFIX = {"glm4_1v": "", "glm4_6v": "<think></think>\n"}


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4v")
    return {name: build_glm4v_dir(root / name, name) for name in GLM_CHECKPOINTS}


@pytest.fixture(scope="module")
def glm_bundles(glm_dirs: dict[str, Path]) -> dict[str, ProcessorBundle]:
    return {name: load_processor(str(path)) for name, path in glm_dirs.items()}


def test_load_processor_builds_the_real_processor_on_cpu(glm_bundles):
    for name, bundle in glm_bundles.items():
        assert bundle.processor_class == PROCESSOR_CLASS[name]
        assert bundle.processor is not None, "real processor not built (verification would be off)"
        assert type(bundle.image_processor).__name__.endswith("ImageProcessorPil")
        counter = find_counter(bundle.processor_class)(bundle)
        assert isinstance(counter, Glm4vCounter)
        assert (counter.patch_size, counter.temporal_patch_size, counter.merge_size) == (14, 2, 2)
        assert (counter.min_pixels, counter.max_pixels) == (12544, 9633792)
        assert counter.image_token_id == bundle.processor.image_token_id
        assert counter.image_token_id == bundle.tokenizer.convert_tokens_to_ids("<|image|>")


# name -> (width, height, mode, format, EXIF orientation)
IMAGES = {
    "tiny1": (1, 1, "RGB", "PNG", None),
    "tiny10": (10, 10, "RGB", "JPEG", None),
    "wide": (3000, 16, "RGB", "PNG", None),  # short side scaled up to 28 first: 5250x28
    "tall": (16, 3000, "RGB", "PNG", None),
    "odd": (333, 517, "RGB", "JPEG", None),
    "odd2": (1537, 29, "RGB", "JPEG", None),
    "ratio199": (5572, 28, "RGB", "PNG", None),  # 199:1, accepted
    "exif6": (96, 40, "RGB", "JPEG", 6),  # stored 96x40, shown 40x96
    "exif8": (1300, 200, "RGB", "JPEG", 8),
    "rgba": (200, 90, "RGBA", "PNG", None),
    "gray": (70, 130, "L", "PNG", None),
    "ratio205": (4100, 20, "RGB", "PNG", None),  # 28 x 5740 after the scale-up: > 200:1, rejected
    "thin": (3000, 1, "RGB", "PNG", None),  # 1 px side -> 84000 x 28: rejected
}
REJECTED = ("ratio205", "thin")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("glm4v_media")
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
    one = [
        {
            "messages": [
                {"role": "user", "content": f"<image>Describe {name}."},
                {"role": "assistant", "content": f"It is {name}."},
            ],
            "images": [f(name)],
        }
        for name in IMAGES
        if name not in REJECTED
    ]
    many = [
        {  # several images in one turn, text touching the tag on both sides
            "messages": [
                {"role": "user", "content": "abc<image><image>def<image>ghi"},
                {"role": "assistant", "content": "Three images."},
            ],
            "images": [f("odd"), f("exif6"), f("huge")],
        },
        {  # images in several turns, with a system prompt
            "messages": [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "And here?<image>"},
                {"role": "assistant", "content": "A dog on a red table."},
                {"role": "user", "content": "12<image>34"},
                {"role": "assistant", "content": "120 trees."},
            ],
            "images": [f("rgba"), f("gray"), f("tall")],
        },
        {  # the same image twice, and the 1x1 beside the 199:1
            "messages": [
                {"role": "user", "content": "<image>1<image><image>"},
                {"role": "assistant", "content": "Same."},
            ],
            "images": [f("tiny1"), f("ratio199"), f("tiny1")],
        },
    ]
    return one + many


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", "utf-8")


def _spec(tmp_path: Path, media_dir: Path, records: list[dict]):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
    config = tmp_path / "dataset_info.json"
    _write_json(config, {"glm": {"file_name": str(data), "formatting": "sharegpt", "media_dir": str(media_dir)}})
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
    out: Any = bundle.processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    return [int(t) for t in np.asarray(out["input_ids"][0]).tolist()]


def _shown_size(im: Image.Image) -> tuple[int, int]:
    orientation = im.getexif().get(0x0112, 1)
    return (im.height, im.width) if orientation in (5, 6, 7, 8) else im.size


@pytest.mark.parametrize("checkpoint", list(GLM_CHECKPOINTS))
def test_sample_tokenizer_equals_the_processor(glm_bundles, media_dir, tmp_path, checkpoint):
    bundle = glm_bundles[checkpoint]
    tokenizer = SampleTokenizer(bundle)
    image_ids = {bundle.tokenizer.convert_tokens_to_ids(t) for t in ("<|begin_of_image|>", "<|image|>")}
    _, spec = _spec(tmp_path, media_dir, _records(media_dir))
    for record in _records(media_dir):
        conv = to_conversation(record, spec)
        sample = tokenizer.tokenize(conv, VideoSampling())
        expected = _hf_ids(bundle, conv.messages, [item.ref.path for item in conv.media])
        assert sample.input_ids == expected, record["images"]
        # loss mask: exactly the assistant turns (the templates end a reply with nothing)
        learned = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        replies = [REPLY_PREFIX[checkpoint] + m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert bundle.tokenizer.decode(learned) == "".join(replies)
        assert sample.loss_mask[-1] == 1
        assert not any(m for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t in image_ids)
        for (_, count), item in zip(sample.media, conv.media, strict=True):
            with Image.open(item.ref.path) as im:
                assert (count.width, count.height) == _shown_size(im)
            assert count.num_tiles == 1 and count.grid_t == 1


@pytest.mark.parametrize("name", REJECTED)
def test_aspect_over_200_is_an_error_like_the_processor(glm_bundles, media_dir, tmp_path, name):
    bundle = glm_bundles["glm4_1v"]
    record = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": [_file(media_dir, name)],
    }
    _, spec = _spec(tmp_path, media_dir, [record])
    conv = to_conversation(record, spec)
    with pytest.raises(ValueError, match="aspect ratio"):
        _hf_ids(bundle, conv.messages, [conv.media[0].ref.path])
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(conv, VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED


def test_video_is_the_real_processor_or_a_clear_error_row(glm_bundles, media_dir, tmp_path):
    bundle = glm_bundles["glm4_1v"]
    assert Glm4vCounter.counts_video is False
    record = {
        "messages": [{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "y"}],
        "videos": ["clip.mp4"],
    }
    _, spec = _spec(tmp_path, media_dir, [record])
    if getattr(bundle.processor, "video_processor", None) is not None:
        pytest.skip("torchvision present: video runs the real processor (covered by its own path)")
    with pytest.raises(SampleError) as err:
        SampleTokenizer(bundle).tokenize(to_conversation(record, spec), VideoSampling())
    assert err.value.reason == Reason.PROCESSOR_REJECTED and "real processor" in str(err.value)


def test_other_image_processor_is_refused_not_guessed(glm_bundles):
    from dataclasses import replace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with pytest.raises(ProcessorLoadError, match="Glm4vImageProcessor"):
        Glm4vCounter.from_processor(replace(glm_bundles["glm4_1v"], image_processor=Qwen2VLImageProcessorPil()))


def _property_sizes(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Log-uniform sides 1..1500, a third with a side under 28 (the scale-up), some on 28-multiples."""
    sizes = []
    for i in range(n):
        w, h = (max(1, int(math.exp(rng.uniform(0, math.log(1500))))) for _ in range(2))
        if i % 3 == 0:
            h = rng.randint(1, 27)
        elif i % 7 == 0:
            w = 28 * rng.randint(1, 50) + rng.choice([-1, 0, 1, 14])
        sizes.append((w, h) if rng.random() < 0.5 else (h, w))
    return sizes


@pytest.mark.parametrize("checkpoint", list(GLM_CHECKPOINTS))
def test_property_grid_equals_the_image_processor(glm_bundles, checkpoint):
    """500 random (width, height): grid and token count equal the PIL image processor's ``image_grid_thw``."""
    bundle = glm_bundles[checkpoint]
    counter = Glm4vCounter.from_processor(bundle)
    ip = bundle.image_processor
    rejected = 0
    for width, height in _property_sizes(random.Random(f"glm-{checkpoint}"), 500):
        image = Image.new("RGB", (width, height))
        try:
            grid = ip(images=[image], do_rescale=False, do_normalize=False)["image_grid_thw"][0]
        except ValueError:
            with pytest.raises(MediaRejected):
                counter.count_image(width, height)
            rejected += 1
            continue
        count = counter.count_image(width, height)
        assert (count.grid_t, count.grid_h, count.grid_w) == tuple(int(v) for v in grid), (width, height)
        assert count.num_tokens == int(np.prod(grid)) // 4 == len(count.expansion), (width, height)
    assert 0 < rejected < 250  # both branches exercised


def test_pixel_budget_counts_the_temporal_patch(glm_bundles):
    """Over max_pixels / 2 (not max_pixels) the image is scaled down: 4000x3000 -> 2520x1876 (w x h)."""
    counter = Glm4vCounter.from_processor(glm_bundles["glm4_1v"])
    ip = glm_bundles["glm4_1v"].image_processor
    for width, height in ((4000, 3000), (2600, 1800), (1920, 1080)):
        grid = ip(images=[Image.new("RGB", (width, height))], do_rescale=False, do_normalize=False)["image_grid_thw"]
        count = counter.count_image(width, height)
        assert (count.grid_h, count.grid_w) == tuple(int(v) for v in grid[0][1:])
        assert 2 * count.grid_h * count.grid_w * 14 * 14 <= counter.max_pixels
    assert counter.count_image(1920, 1080).num_tokens == 2691  # the module docstring's example


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


def test_stage_stores_the_processor_ids_and_error_rows(glm_dirs, glm_bundles, media_dir, tmp_path):
    """``prep tokenize`` on a small dataset (glm4_6v), every sample verified by the stage too."""
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
    records = _records(media_dir)[-2:] + bad
    config, spec = _spec(tmp_path, media_dir, records)
    out = tmp_path / "out"
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(glm_dirs["glm4_6v"]),
            output_dir=str(out),
            verify_fraction=1.0,
            max_error_rate=1.0,
            executor=LOCAL,
        )
    )
    errors = _table(out, ERRORS_DIR).to_pylist()
    assert [e["reason"] for e in errors] == ["processor_rejected", "processor_rejected"]
    rows = _table(out, SAMPLES_DIR).to_pylist()
    assert len(rows) == len(records) - 2 and manifest.verify.checked == len(rows)
    bundle = glm_bundles["glm4_6v"]
    for row in rows:
        conv = to_conversation(records[row["line"]], spec)
        assert row["input_ids"] == _hf_ids(bundle, conv.messages, [i.ref.path for i in conv.media])
