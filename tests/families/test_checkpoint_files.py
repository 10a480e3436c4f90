"""The example processors' checkpoint files against public copies of the real ones (issue 30).

Each value pinned here was compared with the source named beside it (repository, file, commit);
``families/<name>/example.py`` records the provenance of every value, verified or not. A change
to one of these values changes token counts or assistant masks, so it must come with a source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from families.gemma4.example import GEMMA4_CHAT_TEMPLATE
from families.kimi_k25.example import KIMI_K25_TEMPLATE
from families.lfm2_vl.example import CHAT_TEMPLATE as LFM2_VL_TEMPLATE
from families.lfm2_vl.example import PREPROCESSOR_CONFIG as LFM2_VL_SETTINGS
from families.minicpmv4_6.example import IMAGE_SETTINGS as MINICPMV4_6_SETTINGS
from families.minicpmv4_6.example import MINICPMV4_6_CHAT_TEMPLATE
from families.paddleocr_vl.example import IMAGE_SETTINGS as PADDLEOCR_VL_SETTINGS
from families.paddleocr_vl.example import PADDLEOCR_VL_CHAT_TEMPLATE


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The template as transformers renders a chat template (its sandboxed jinja environment)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return str(_compile_jinja_template(template).render(messages=messages, **kwargs))


def test_lfm2_vl_template_and_image_settings_are_the_checkpoints() -> None:
    # varun00391/local-finetuned-model LiquidAI:LFM2-VL-450M/lfm2-450m/chat_template.jinja @ a913c339
    # (434 characters): equal character for character
    assert _sha256(LFM2_VL_TEMPLATE) == "cf0af741b36248dfe460af825b0b3acb3c651cf7dd40a74c29447f60b75d2b9b"
    # ... processor_config.json @ a913c339 (the image settings the counter reads)
    checkpoint = {
        "do_image_splitting": True,
        "downsample_factor": 2,
        "encoder_patch_size": 16,
        "max_image_tokens": 256,
        "max_num_patches": 1024,
        "max_pixels_tolerance": 2.0,
        "max_tiles": 10,
        "min_image_tokens": 64,
        "min_tiles": 2,
        "tile_size": 512,
        "use_thumbnail": False,
    }
    assert {k: LFM2_VL_SETTINGS[k] for k in checkpoint} == checkpoint
    # ... preprocessor_config.json @ a913c339 (pixels)
    assert LFM2_VL_SETTINGS["resample"] == 2 and LFM2_VL_SETTINGS["image_mean"] == LFM2_VL_SETTINGS["image_std"]
    assert LFM2_VL_SETTINGS["image_mean"] == [0.5, 0.5, 0.5]


def test_paddleocr_vl_template_and_pixel_limits_are_the_checkpoints() -> None:
    # the copy of PaddlePaddle/PaddleOCR-VL chat_template.jinja in the code index (file 70290682601, the
    # "Assistant:\n" revision; its repository is not named by the index): equal character for character
    assert _sha256(PADDLEOCR_VL_CHAT_TEMPLATE) == "2f27812dab7f333e471884e0c803d807f11953d5453140dfb1aaba234f872bc8"
    # huggingface/candle candle-examples/examples/paddleocr-vl/main.rs @ 2c4d4407, "from
    # preprocessor_config.json" (transformers' class defaults are 384 * 384 and 1536 * 1536)
    assert (PADDLEOCR_VL_SETTINGS["min_pixels"], PADDLEOCR_VL_SETTINGS["max_pixels"]) == (147384, 2822400)
    assert (PADDLEOCR_VL_SETTINGS["patch_size"], PADDLEOCR_VL_SETTINGS["merge_size"]) == (14, 2)
    assert PADDLEOCR_VL_SETTINGS["temporal_patch_size"] == 1


def test_gemma4_template_renders_as_the_checkpoints() -> None:
    """ggml-org/llama.cpp models/templates/gemma4.jinja @ 75f1ba73, the parts a conversation without
    tools reaches: BOS, the system turn (``<|think|>`` first when thinking), trimmed text, images as
    ``"\\n\\n<|image|>\\n\\n"``, thought channels stripped from replies, the empty thought channel the
    generation prompt closes unless thinking is on."""
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is it? "}]},
        {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>A cat."},
        {"role": "user", "content": "Sure?"},
    ]
    text = _render(GEMMA4_CHAT_TEMPLATE, messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n"
        "<|turn>user\n\n\n<|image|>\n\nWhat is it?<turn|>\n"
        "<|turn>model\nA cat.<turn|>\n"
        "<|turn>user\nSure?<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    thinking = _render(
        GEMMA4_CHAT_TEMPLATE, messages[1:2], bos_token="<bos>", add_generation_prompt=True, enable_thinking=True
    )
    assert (
        thinking
        == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n\n\n<|image|>\n\nWhat is it?<turn|>\n<|turn>model\n"
    )


def test_minicpmv4_6_template_and_image_settings_are_the_checkpoints() -> None:
    """sophgo/LLM-TPU models/MiniCPMV4_6/config/chat_template.jinja @ e2815801 (openbmb/MiniCPM-V-4.6-AWQ's
    files; 7301 characters, as that folder's tokenizer_config.json @ bea5f3e4 embeds it), equal character
    for character; baidu-baige/LoongForge minicpm_v_4_6_hf_training.jinja @ c6275661 is the same text with
    generation blocks added. What it renders: enable_thinking false unless passed (an empty think block
    closes the generation prompt), items joined by newlines, reasoning kept after the last user turn only."""
    assert len(MINICPMV4_6_CHAT_TEMPLATE) == 7301
    assert _sha256(MINICPMV4_6_CHAT_TEMPLATE) == "dfe1fa43a3444f065406d3a2b9aa315602f5c146b80cf22e0426a6c1466d85aa"
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "<think>\nLook.\n</think>\n\nA cat."},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}, {"type": "video"}]},
    ]
    text = _render(MINICPMV4_6_CHAT_TEMPLATE, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|image_pad|>\nWhat is it?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nSure?\n<|video_pad|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = _render(MINICPMV4_6_CHAT_TEMPLATE, messages, add_generation_prompt=True, enable_thinking=True)
    assert thinking == text.removesuffix("<think>\n\n</think>\n\n") + "<think>\n"
    replied = _render(MINICPMV4_6_CHAT_TEMPLATE, [*messages[:2], {"role": "assistant", "content": "A cat."}])
    assert replied.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA cat.<|im_end|>\n")
    # processor_config.json @ e2815801 (image_processor)
    checkpoint = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "downsample_mode": "16x",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_slice_nums": 9,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "scale_resolution": 448,
        "slice_mode": True,
        "use_image_id": True,
    }
    assert MINICPMV4_6_SETTINGS == checkpoint


KIMI_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"


def test_kimi_k25_template_renders_as_the_checkpoints() -> None:
    """K2.5's chat_template.jinja as two public copies carry it, each with its user's edit undone:
    radixark/miles miles/utils/chat_template_utils/templates/kimi_k25_fixed.jinja @ 31f1ca96 (a
    preserve_thinking switch) and baidu-baige/LoongForge loongforge/data/chat_templates/kimi_k2_5_training.jinja
    @ c6275661 (generation blocks). No default system turn (Kimi-K2-Thinking's template has one); each image
    and each video followed by a newline; every message up to the last reply without tool calls is
    history, whose replies carry an empty ``<think></think>``; replies after it keep their reasoning unless
    ``thinking`` is false; the generation prompt opens ``<think>``. Before this was checked, the example
    had K2-Thinking's default system turn and no newline after a video."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
    reply = {"role": "assistant", "content": "A cat.", "reasoning_content": "look"}
    finished = _render(KIMI_K25_TEMPLATE, [user, reply])
    assert finished == (
        f"<|im_user|>user<|im_middle|>{KIMI_IMAGE}What?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A cat.<|im_end|>"
    )
    video = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And?"}]}
    assert (
        _render(KIMI_K25_TEMPLATE, [video])
        == "<|im_user|>user<|im_middle|><|kimi_k25_video_placeholder|>\nAnd?<|im_end|>"
    )
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    tool_call = {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"}
    kept = _render(KIMI_K25_TEMPLATE, [{"role": "system", "content": "S"}, user, reply, user, tool_call, result])
    assert kept.startswith("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>")
    assert kept.endswith(
        "<|im_assistant|>assistant<|im_middle|><think>call it</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of functions.f:0\n42<|im_end|>"
    )
    assert kept.count("<think></think>A cat.") == 1
    off = _render(KIMI_K25_TEMPLATE, [user, reply, user, tool_call], thinking=False)
    assert "<think>call it</think>" not in off and "<|im_middle|><think></think><|tool_calls_section_begin|>" in off
    prompt = _render(KIMI_K25_TEMPLATE, [user], add_generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert _render(KIMI_K25_TEMPLATE, [user], add_generation_prompt=True, thinking=False).endswith("<think></think>")


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from families.kimi_k25.example import EXAMPLES

    root: Path = EXAMPLES[0].build_processor(tmp_path_factory.mktemp("kimi") / "processor")
    return AutoTokenizer.from_pretrained(str(root))


def test_kimi_k25_masks_train_the_reply_after_the_think_prefill(kimi_tokenizer: Any) -> None:
    """The mask of each reply starts after the generation prompt's ``<think>``: ``</think>`` + reply +
    ``<|im_end|>``, the reasoning of history replies dropped as the checkpoint's template drops it."""
    from prep.tokenize.template import render_with_spans

    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
    messages = [
        user,
        {"role": "assistant", "content": "A cat.", "reasoning_content": "look"},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "check"},
    ]
    rendered = render_with_spans(kimi_tokenizer, KIMI_K25_TEMPLATE, messages)
    assert rendered.text.startswith("<|im_user|>user<|im_middle|>")
    assert [rendered.text[a:b] for a, b in rendered.assistant_spans] == [
        "</think>A cat.<|im_end|>",
        "</think>Yes.<|im_end|>",
    ]


def test_kimi_k25_tool_call_markers_are_single_special_tokens(kimi_tokenizer: Any) -> None:
    """The markers the template writes around tool calls are K2's special tokens (163595..163599 upstream,
    after ``<|im_system|>`` and before ``<|im_middle|>``): one token each, never split into text."""
    markers = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"]
    markers += ["<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    ids = [kimi_tokenizer(m, add_special_tokens=False)["input_ids"] for m in markers]
    order = [kimi_tokenizer.convert_tokens_to_ids(t) for t in ["<|im_system|>", *markers, "<|im_middle|>"]]
    assert all(len(i) == 1 for i in ids) and order == list(range(order[0], order[0] + 7))
