"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL example processors (and the tiny models ``train`` runs)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from prep.example.families.base import ExampleFamily, register_example_family
from prep.example.model import write_tiny_model
from prep.example.processors import FAMILIES, build_processor_dir

CHECKPOINTS = {
    "qwen2_vl": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2_5_vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3_vl": "Qwen/Qwen3-VL-8B-Instruct",
}


def _model(family: str, model_dir: Path, processor_dir: Path) -> Path:
    return write_tiny_model(model_dir, family, processor_dir)


for _family in FAMILIES:
    register_example_family(
        ExampleFamily(
            name=_family,
            build_processor=partial(build_processor_dir, family=_family),
            description=f"tokenizer format, chat template and image/video settings of {CHECKPOINTS[_family]}",
            build_model=partial(_model, _family),
        )
    )
