"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL example processors and the tiny models ``train`` runs.

Qwen2-VL and Qwen2.5-VL are this family's examples; Qwen3-VL's (`qwen_vl_example`) is the
``qwen3_vl`` family's, built by the same code.

The tiny configs (:mod:`families.example.model` scaffolding) take from the processor directory the
vocabulary size, the ids of ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``,
``<|vision_end|>`` and the patch geometry (``patch_size``, ``merge_size``,
``temporal_patch_size``). ``mrope_section`` splits the rotary half-dimension (head_dim / 2 = 8)
over t/h/w, as the real checkpoints split 64 as [16, 24, 24] (Qwen2/2.5-VL) or interleave
[24, 20, 20] (Qwen3-VL); the vision towers are 2 blocks of width 32.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from families.example.base import ExampleFamily
from families.example.model import (
    HEAD_DIM,
    TEXT_HIDDEN,
    VISION_DEPTH,
    VISION_HEADS,
    VISION_HIDDEN,
    ProcessorFacts,
    TinyModel,
    text_config,
)
from families.qwen2_vl.processor_dir import build_processor_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINTS = {
    "qwen2_vl": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2_5_vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3_vl": "Qwen/Qwen3-VL-8B-Instruct",
}
QWEN_VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# (t, h, w) split of the rotary half-dimension 8
QWEN2_MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
QWEN3_MROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def token_ids(facts: ProcessorFacts, tokens: dict[str, str]) -> dict[str, Any]:
    """Config field -> the tokenizer's id of its token."""
    return {name: facts.token_id(token) for name, token in tokens.items()}


def patch_geometry(facts: ProcessorFacts) -> dict[str, int]:
    """``patch_size``, ``spatial_merge_size``, ``temporal_patch_size`` of a Qwen-rule image processor."""
    image = facts.image
    return {
        "patch_size": int(image["patch_size"]),
        "spatial_merge_size": int(image["merge_size"]),
        "temporal_patch_size": int(image["temporal_patch_size"]),
    }


def qwen2_5_vision(facts: ProcessorFacts) -> dict[str, Any]:
    """The Qwen2.5-VL vision tower (Qwen2.5-Omni reuses it): windowed blocks as in the checkpoints
    (112 px windows), the last block full attention."""
    vision: dict[str, Any] = {"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_heads": VISION_HEADS}
    vision |= {"intermediate_size": 2 * VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN, **patch_geometry(facts)}
    return vision | {"window_size": 112, "fullatt_block_indexes": [VISION_DEPTH - 1]}


def qwen3_vision(facts: ProcessorFacts) -> dict[str, Any]:
    """The Qwen3-VL vision tower (Qwen3.5 and Qwen3-Omni reuse it): learned 8x8 position grid, deepstack at block 0."""
    vision = {"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_heads": VISION_HEADS}
    vision |= {"intermediate_size": 2 * VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN, **patch_geometry(facts)}
    return vision | {"num_position_embeddings": 64}


def qwen_vl_config(family: str, facts: ProcessorFacts) -> PretrainedConfig:
    """The tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL config for ``facts``' processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    common = {**token_ids(facts, QWEN_VISION_TOKENS), "tie_word_embeddings": True, "dtype": "float32"}
    patches = patch_geometry(facts)
    if family == "qwen2_vl":
        vision: dict[str, Any] = {"depth": VISION_DEPTH, "embed_dim": VISION_HIDDEN, "num_heads": VISION_HEADS}
        vision |= {"mlp_ratio": 2, "hidden_size": TEXT_HIDDEN, **patches}
        return Qwen2VLConfig(
            text_config=text_config(facts, rope_parameters=QWEN2_MROPE), vision_config=vision, **common
        )
    if family == "qwen2_5_vl":
        vision = qwen2_5_vision(facts) | {"tokens_per_second": 2}
        text = text_config(facts, rope_parameters=QWEN2_MROPE)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    text = text_config(facts, rope_parameters=QWEN3_MROPE, head_dim=HEAD_DIM)
    vision = qwen3_vision(facts) | {"deepstack_visual_indexes": [0]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **common)


def qwen_vl_example(family: str) -> ExampleFamily:
    """The example of one of `FAMILIES` (Qwen3-VL's is the qwen3_vl family's)."""
    return ExampleFamily(
        name=family,
        build_processor=partial(build_processor_dir, family=family),
        description=f"tokenizer format, chat template and image/video settings of {CHECKPOINTS[family]}",
        build_model=TinyModel(partial(qwen_vl_config, family)),
    )


EXAMPLES = (qwen_vl_example("qwen2_vl"), qwen_vl_example("qwen2_5_vl"))
