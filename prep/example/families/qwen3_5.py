"""Qwen3.5 example processor: ``Qwen3VLProcessor`` with the Qwen3.5 tokenizer class.

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

from prep.example.families.base import ExampleFamily, register_example_family
from prep.example.processors import build_processor_dir as build_qwen_dir

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


register_example_family(
    ExampleFamily(
        name="qwen3_5",
        build_processor=build_processor_dir,
        description=f"{CHECKPOINT}: Qwen3VLProcessor + Qwen3_5Tokenizer, Qwen3-VL image settings (patch 16, merge 2)",
    )
)
