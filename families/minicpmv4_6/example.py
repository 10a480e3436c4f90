"""MiniCPM-V 4.6 example processor: an offline ``MiniCPMV4_6Processor`` directory and a tiny model.

The checkpoint is ``openbmb/MiniCPM-V-4.6`` (the ``auto_docstring`` checkpoint of transformers
5.24 ``configuration_minicpmv4_6``; the model docs load ``openbmb/MiniCPM-V-4_6``): a SigLIP
tower with a 2x2 window-attention merger after layer ``insert_layer_id`` and a 2x2 MLP merger
(16 patches per token in ``"16x"`` mode), over a Qwen3.5 hybrid decoder (gated delta net +
gated full attention).

The directory is the Qwen3.5 example's (`families.qwen3_vl.example`: the small BPE with the
Qwen special tokens, the Qwen3-VL / Qwen3.5 chat template) plus MiniCPM-V's markup tokens
(``<image>``, ``</image>``, ``<slice>``, ``</slice>``, ``<image_id>``, ``</image_id>``, special,
named in ``extra_special_tokens`` as the processor reads them: ``tokenizer.image_start_token``
...). The image placeholder is ``<|image_pad|>`` (the checkpoint's template renders it; the
processor wraps it in ``<image>`` ... ``</image>`` itself), so an image item renders as the bare
``<|image_pad|>``. Image settings: ``MiniCPMV4_6ImageProcessorPil``'s class values, which the
checkpoint's preprocessor_config.json carries (scale_resolution 448, patch_size 14,
max_slice_nums 9, slice_mode true, downsample_mode "16x", use_image_id true, ImageNet standard
mean/std 0.5); the checkpoint's files could not be read offline, so these are the documented
class values, not a copy of the file.

Provenance: image settings are ``MiniCPMV4_6ImageProcessorPil``'s class defaults, not verified
against the checkpoint's ``preprocessor_config.json``; transformers' own processor test
(huggingface/transformers ``tests/models/minicpmv4_6/test_processing_minicpmv4_6.py`` @ 05ac5107,
whose tiny processor is made from openbmb/MiniCPM-V-4_6) names the checkpoint's
``scale_resolution`` 448 and ``max_slice_nums`` 9, which agree. The chat template and special
tokens are the Qwen3.5 example's plus MiniCPM-V's markup: not verified against the checkpoint,
and known to differ in one respect: transformers' model doc (``docs/source/en/model_doc/minicpmv4_6.md``
@ 0d7e95d9) says the checkpoint's template takes ``enable_thinking``, which this one ignores (what
its generation prompt and replies then render, and so the masks, is unverified). The hub id the
docs load is ``openbmb/MiniCPM-V-4_6``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.qwen3_vl.example import LINEAR_ATTENTION, QWEN3_5_ROPE
from families.qwen3_vl.example import build_processor_dir as build_qwen3_5_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "openbmb/MiniCPM-V-4.6"
MARKUP_TOKENS = {
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", **MARKUP_TOKENS}
# MiniCPMV4_6ImageProcessorPil / MiniCPMV4_6VideoProcessor class values (transformers 5.24)
IMAGE_SETTINGS: dict[str, Any] = {
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
PROCESSOR_CLASS = "MiniCPMV4_6Processor"


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def build_minicpmv4_6_dir(out_dir: Path) -> Path:
    """Write the MiniCPM-V 4.6-like processor directory (deterministic)."""
    out = build_qwen3_5_dir(Path(out_dir))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    markup = list(MARKUP_TOKENS.values())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in markup])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    config = json.loads((out / "tokenizer_config.json").read_text("utf-8"))
    for i, token in enumerate(markup):
        config["added_tokens_decoder"][str(first + i)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    for key in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
        config.pop(key, None)
    config["extra_special_tokens"] = NAMED_TOKENS
    config["tokenizer_class"] = "TokenizersBackend"
    _write_json(out / "tokenizer_config.json", config)
    template = (out / "chat_template.jinja").read_text("utf-8")
    image_item = "<|vision_start|><|image_pad|><|vision_end|>"
    video_item = "<|vision_start|><|video_pad|><|vision_end|>"
    if image_item not in template or video_item not in template:
        raise ValueError("the Qwen3.5 example template no longer renders <|vision_start|><|image_pad|><|vision_end|>")
    template = template.replace(image_item, "<|image_pad|>").replace(video_item, "<|video_pad|>")
    (out / "chat_template.jinja").write_text(template, "utf-8")
    image = {**IMAGE_SETTINGS, "image_processor_type": "MiniCPMV4_6ImageProcessor", "processor_class": PROCESSOR_CLASS}
    _write_json(out / "preprocessor_config.json", image)
    video = {
        **IMAGE_SETTINGS,
        "max_num_frames": 128,
        "video_processor_type": "MiniCPMV4_6VideoProcessor",
        "processor_class": PROCESSOR_CLASS,
    }
    _write_json(out / "video_preprocessor_config.json", video)
    _write_json(out / "processor_config.json", {"processor_class": PROCESSOR_CLASS})
    _write_json(
        out / "config.json", {"architectures": ["MiniCPMV4_6ForConditionalGeneration"], "model_type": "minicpmv4_6"}
    )
    return out


def minicpmv4_6_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``MiniCPMV4_6Config``: SigLIP-like tower at patch 14 (merger after layer 0), hybrid Qwen3.5 decoder."""
    from transformers import MiniCPMV4_6Config

    patch = int(facts.image["patch_size"])
    side = int(facts.image["scale_resolution"])
    vision = vision_config(
        model_type="minicpmv4_6_vision", image_size=side, patch_size=patch, hidden_act="gelu_pytorch_tanh"
    )
    text = text_config(facts, model_type="qwen3_5_text", head_dim=HEAD_DIM, rope_parameters=QWEN3_5_ROPE)
    text.update(LINEAR_ATTENTION)
    return MiniCPMV4_6Config(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        image_size=side,
        image_token_id=facts.token_id(NAMED_TOKENS["image_token"]),
        video_token_id=facts.token_id(NAMED_TOKENS["video_token"]),
        downsample_mode=str(facts.image["downsample_mode"]),
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="minicpmv4_6",
        build_processor=build_minicpmv4_6_dir,
        description=f"{CHECKPOINT}: MiniCPMV4_6Processor, Qwen3.5 tokenizer + MiniCPM-V markup tokens, "
        "448 px slices (<= 9), 16x downsampling",
        build_model=TinyModel(minicpmv4_6_model_config),
    ),
)
