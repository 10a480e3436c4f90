"""A tiny, weightless Qwen-VL model config that matches an example processor directory.

``train hf --model DIR`` accepts a directory holding only ``config.json``: the model is then
initialised at random from the config with ``--seed`` (see :func:`train.models.load_model`).
This module writes such a directory for the example processors, so the quickstart and the
tests train a real ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VL...`` / ``Qwen3VL...``
on CPU in seconds. What must match the processor is read from the processor directory:

    vocab_size                     len(tokenizer) (BPE + added specials, ~3014)
    image/video/vision_start/end   the tokenizer's ids of <|image_pad|>, <|video_pad|>, ...
    patch_size, spatial_merge_size, temporal_patch_size   preprocessor_config.json

Everything else is small on purpose (2 text layers, hidden 64, 4 heads, 2 kv heads, head_dim
16; a 2-block vision tower of width 32). ``mrope_section`` splits the rotary half-dimension
(head_dim / 2 = 8) over t/h/w, as the real checkpoints split 64 as [16, 24, 24] (Qwen2/2.5-VL)
or interleave [24, 20, 20] (Qwen3-VL).

Qwen3.5 (``qwen3_5``) is left out: its hybrid linear-attention layers ignore ``cu_seqlens``
in transformers' torch fallback, so packed samples would leak into each other on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported on use: `prep --help` stays fast
    from transformers import PretrainedConfig

MODEL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TEXT_HIDDEN = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
HEAD_DIM = TEXT_HIDDEN // TEXT_HEADS  # 16: rotary half-dimension 8
VISION_HIDDEN = 32
VISION_HEADS = 2
VISION_DEPTH = 2


def _processor_settings(processor_dir: Path) -> dict[str, Any]:
    """Token ids, vocabulary size and patch geometry of the processor the model must accept."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(processor_dir))
    tokens = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    ids: dict[str, int] = {}
    for name, token in tokens.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ValueError(f"{processor_dir}: tokenizer has no {token!r}; is it a Qwen-VL processor?")
        ids[name] = int(token_id)
    image = json.loads((Path(processor_dir) / "preprocessor_config.json").read_text("utf-8"))
    return {
        "ids": ids,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "patch_size": int(image["patch_size"]),
        "spatial_merge_size": int(image["merge_size"]),
        "temporal_patch_size": int(image["temporal_patch_size"]),
    }


def _text_config(settings: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": settings["vocab_size"],
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 2 * TEXT_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": TEXT_KV_HEADS,
        "max_position_embeddings": 32768,
        "rope_parameters": rope,
        "eos_token_id": settings["eos_token_id"],
        "pad_token_id": settings["pad_token_id"],
        "bos_token_id": None,
        "dtype": "float32",
    }


def tiny_model_config(family: str, processor_dir: str | Path) -> PretrainedConfig:
    """A small random-init config of ``family`` that accepts ``processor_dir``'s inputs.

    Args:
        family: One of ``MODEL_FAMILIES``.
        processor_dir: A processor directory (e.g. ``prep.example.processors.build_processor_dir``).

    Returns:
        The model config; ``AutoModelForImageTextToText.from_config`` builds the model.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    if family not in MODEL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {MODEL_FAMILIES}")
    s = _processor_settings(Path(processor_dir))
    patches = {k: s[k] for k in ("patch_size", "spatial_merge_size", "temporal_patch_size")}
    common = {**s["ids"], "tie_word_embeddings": True, "dtype": "float32"}
    if family == "qwen2_vl":
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
        vision: dict[str, Any] = {"depth": VISION_DEPTH, "embed_dim": VISION_HIDDEN, "num_heads": VISION_HEADS}
        vision["mlp_ratio"] = 2
        vision |= {"hidden_size": TEXT_HIDDEN, **patches}
        return Qwen2VLConfig(text_config=_text_config(s, rope), vision_config=vision, **common)
    if family == "qwen2_5_vl":
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
        vision = {"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_heads": VISION_HEADS}
        vision |= {"intermediate_size": 2 * VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN, **patches}
        # Windowed blocks as in the checkpoints (112 px windows), the last block full attention.
        vision |= {"window_size": 112, "fullatt_block_indexes": [VISION_DEPTH - 1], "tokens_per_second": 2}
        return Qwen2_5_VLConfig(text_config=_text_config(s, rope), vision_config=vision, **common)
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = _text_config(s, rope) | {"head_dim": HEAD_DIM}
    vision = {"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_heads": VISION_HEADS}
    vision |= {"intermediate_size": 2 * VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN, **patches}
    vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **common)


def write_tiny_model(out_dir: str | Path, family: str, processor_dir: str | Path) -> Path:
    """Write ``config.json`` and ``generation_config.json`` (no weights) to ``out_dir``.

    ``AutoConfig.from_pretrained(out_dir)`` loads it; ``train.models.load_model(out_dir, seed=...)``
    initialises the weights at random. Same arguments give the same bytes.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    config = tiny_model_config(family, processor_dir)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return out_dir
