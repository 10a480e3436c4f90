"""The ``Qwen3VLProcessor`` family's examples: Qwen3-VL, and Qwen3.5 (the Qwen3.5 tokenizer class).

Qwen3-VL's example is built like Qwen2-VL's (`families.qwen2_vl.example`, one directory writer
for the three Qwen-VL checkpoints). Qwen3.5:

transformers 5.23 has a ``qwen3_5`` model (``models/qwen3_5``: checkpoint Qwen/Qwen3.5-27B) and
no processor of its own: ``processing_auto`` maps ``qwen3_5`` / ``qwen3_5_moe`` to
``Qwen3VLProcessor``, ``image_processing_auto`` to ``Qwen2VLImageProcessor(Pil)``,
``video_processing_auto`` to ``Qwen3VLVideoProcessor``, ``tokenization_auto`` to
``Qwen3_5Tokenizer`` (a BPE whose pre-tokenizer regex also keeps combining marks, ``\\p{M}``,
with letters). ``configuration_qwen3_5.Qwen3_5VisionConfig``: patch 16, spatial merge 2,
temporal patch 2, so the image factor is 32 as in Qwen3-VL.

The directory is the Qwen3-VL example's (same special tokens, chat template, image and video
settings: patch 16, merge 2, 65536..16777216 image pixels) with the Qwen3.5 differences: the
tokenizer class ``Qwen3_5Tokenizer`` (which rebuilds its pre-tokenizer with the Qwen3.5 regex)
and ``config.json`` ``model_type: qwen3_5``. The Qwen3.5 checkpoints' own preprocessor and
template files could not be read offline: their pixel limits are taken to be Qwen3-VL's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from families.example.base import ExampleFamily
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config
from families.qwen2_vl.example import QWEN_VISION_TOKENS, qwen3_vision, qwen_vl_example, token_ids
from families.qwen2_vl.processor_dir import build_processor_dir as build_qwen_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "Qwen/Qwen3.5-27B"


def _update_json(path: Path, **changes: object) -> None:
    payload = json.loads(path.read_text("utf-8"))
    payload.update(changes)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def build_processor_dir(out_dir: Path) -> Path:
    """Write the Qwen3.5 processor directory (deterministic); loads as ``Qwen3VLProcessor``."""
    out_dir = build_qwen_dir(Path(out_dir), "qwen3_vl")
    _update_json(out_dir / "tokenizer_config.json", tokenizer_class="Qwen3_5Tokenizer")
    _update_json(out_dir / "config.json", model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"])
    return out_dir


# Qwen3.5 rotates a quarter of each 256-wide head, interleaving [11, 11, 10] over t/h/w; with
# head_dim 16 a quarter (rotary half-dimension 2) cannot hold three sections: half the head
# rotates here (half-dimension 4, interleaved [2, 1, 1]).
QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
# One gated-delta-net layer and one gated full-attention layer (the checkpoints: 3 to 1), tiny
# linear-attention heads (2 key heads, 4 value heads of width 8; the 4-tap causal conv kept).
LINEAR_ATTENTION = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def qwen3_5_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny hybrid ``Qwen3_5Config`` for ``facts``' processor: Qwen3-VL ids and vision geometry (patch 16, merge 2)."""
    from transformers import Qwen3_5Config

    text = text_config(facts, head_dim=HEAD_DIM, rope_parameters=QWEN3_5_ROPE, **LINEAR_ATTENTION)
    return Qwen3_5Config(
        text_config=text,
        vision_config=qwen3_vision(facts),
        **token_ids(facts, QWEN_VISION_TOKENS),
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = (
    qwen_vl_example("qwen3_vl"),
    ExampleFamily(
        name="qwen3_5",
        build_processor=build_processor_dir,
        description=f"{CHECKPOINT}: Qwen3VLProcessor + Qwen3_5Tokenizer, Qwen3-VL image settings (patch 16, merge 2)",
        build_model=TinyModel(qwen3_5_model_config),
    ),
)
