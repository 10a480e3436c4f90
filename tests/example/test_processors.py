"""The generated Qwen-VL processor directory loads with transformers and renders real formats.

Oracles: chat strings written out by hand in the published Qwen formats, token counts
from smart_resize done by hand, and the files' own bytes (determinism).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoProcessor, AutoTokenizer
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # not torchvision-gated (5.8 - 5.12)

from families.example.tokenizer import QWEN3_EXTRA_TOKENS, SPECIAL_TOKENS
from families.qwen2_vl.processor_dir import FAMILIES, build_processor_dir
from prep.example.media import make_image_bytes

TEXTS = [
    "Hello, world! 12345 + 67 = 12412",
    "  leading spaces\n\n\ttabs and\r\nCRLF  ",
    "这是一只猫。图片里有什么？ こんにちは 안녕 Привет",
    "emoji 😀🐱🚗 ❤️ 👍🏽 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ",
    "def f(x: int) -> int:\n    return x ** 2  # square",
]
CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And here?"}]},
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("proc")
    return {f: build_processor_dir(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers_(dirs: dict[str, Path]) -> dict:
    return {f: AutoTokenizer.from_pretrained(d) for f, d in dirs.items()}


def test_build_is_byte_identical(dirs: dict[str, Path], tmp_path: Path) -> None:
    for family, first in dirs.items():
        again = build_processor_dir(tmp_path / family, family)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        assert all((first / n).read_bytes() == (again / n).read_bytes() for n in names)


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        build_processor_dir(tmp_path, "llava")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips_and_matches_tokenizer_json(family, dirs, tokenizers_) -> None:
    tok = tokenizers_[family]
    raw = Tokenizer.from_file(str(dirs[family] / "tokenizer.json"))
    assert type(tok).__name__ == "Qwen2Tokenizer"
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert raw.encode(text, add_special_tokens=False).ids == ids
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5  # Qwen2 pre-tokenizer splits single digits


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_are_single_ids_in_upstream_order(family, tokenizers_) -> None:
    tok = tokenizers_[family]
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(3000, 3000 + len(SPECIAL_TOKENS)))
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tok(token, add_special_tokens=False)["input_ids"] == [token_id]
        assert tok(f"a{token}b", add_special_tokens=False)["input_ids"].count(token_id) == 1
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.image_token == "<|image_pad|>" and tok.image_token_id == ids[12]
    assert tok.video_token_id == ids[13] and tok.vision_start_token_id == ids[9]
    think = [tok(t, add_special_tokens=False)["input_ids"] for t in QWEN3_EXTRA_TOKENS]
    if family == "qwen3_vl":
        assert think == [[3014], [3015]]
        assert "<think>" not in tok.all_special_tokens  # added, not special
    else:
        assert all(len(t) > 1 for t in think)


def test_qwen2_vl_chat_template_renders_the_published_format(tokenizers_) -> None:
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>And here?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for family in ("qwen2_vl", "qwen2_5_vl"):
        tok = tokenizers_[family]
        text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
        assert text == expected
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizers_["qwen2_vl"].apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_qwen3_vl_chat_template_has_no_default_system(tokenizers_) -> None:
    tok = tokenizers_["qwen3_vl"]
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>And here?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nHello."},
    ]
    assert tok.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nok\n</think>\n\nHello.<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("family", "patch", "min_px", "max_px", "mean"),
    [
        ("qwen2_vl", 14, 3136, 12845056, 0.48145466),
        ("qwen2_5_vl", 14, 3136, 12845056, 0.48145466),
        ("qwen3_vl", 16, 65536, 16777216, 0.5),
    ],
)
def test_auto_image_processor_loads_pil_class_with_checkpoint_settings(
    family, patch, min_px, max_px, mean, dirs
) -> None:
    processor = AutoImageProcessor.from_pretrained(dirs[family], backend="pil")
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (
        patch,
        2,
        2,
    )
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (min_px, max_px)
    assert processor.image_mean[0] == pytest.approx(mean)
    assert AutoConfig.from_pretrained(dirs[family]).model_type == family


def test_video_config_has_checkpoint_values(dirs) -> None:
    qwen2 = json.loads((dirs["qwen2_vl"] / "video_preprocessor_config.json").read_text())
    assert qwen2["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert qwen2["size"] == {"longest_edge": 12845056, "shortest_edge": 3136}
    assert (qwen2["patch_size"], qwen2["min_frames"], qwen2["max_frames"]) == (14, 4, 768)
    qwen3 = json.loads((dirs["qwen3_vl"] / "video_preprocessor_config.json").read_text())
    assert qwen3["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert qwen3["size"] == {"longest_edge": 25165824, "shortest_edge": 4096}
    assert (qwen3["patch_size"], qwen3["fps"], qwen3["do_sample_frames"]) == (16, 2, True)


def _image_only(base: type) -> type:
    """The construction that works without torchvision: drop the video processor slot."""

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnly


@pytest.mark.parametrize(("family", "num_image_tokens"), [("qwen2_vl", 17 * 23), ("qwen3_vl", 15 * 20)])
def test_image_only_processor_expands_image_tokens(family, num_image_tokens, dirs, tokenizers_):
    """640x480: Qwen2 factor 28 -> 476x644 -> 17x23 tokens; Qwen3 factor 32 -> 480x640 -> 15x20."""
    import io

    from transformers import Qwen2VLProcessor, Qwen3VLProcessor

    base = Qwen2VLProcessor if family == "qwen2_vl" else Qwen3VLProcessor
    processor = _image_only(base)(
        image_processor=AutoImageProcessor.from_pretrained(dirs[family], backend="pil"),
        tokenizer=tokenizers_[family],
        chat_template=(dirs[family] / "chat_template.jinja").read_text(),
    )
    image = Image.open(io.BytesIO(make_image_bytes(640, 480))).convert("RGB")
    text = processor.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[image], return_tensors="np")
    assert (out["input_ids"][0] == processor.image_token_id).sum() == num_image_tokens
    assert int(out["image_grid_thw"][0].prod()) == 4 * num_image_tokens


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present")
def test_auto_processor_needs_torchvision(dirs) -> None:
    with pytest.raises(ImportError, match="requires the Torchvision library"):
        AutoProcessor.from_pretrained(dirs["qwen2_vl"])
