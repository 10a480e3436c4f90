"""The tiny Qwen-VL model configs match their processors: token ids, vocabulary, patch geometry, rope.

Every family's model against its real processor output: ``test_models_all_families.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from families.qwen2_vl.processor_dir import FAMILIES, build_processor_dir
from prep.example.model import tiny_model_config, write_tiny_model

TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_matches_processor(family: str, tmp_path: Path) -> None:
    processor_dir = build_processor_dir(tmp_path / "processor", family)
    out = write_tiny_model(tmp_path / "model", family, processor_dir)
    config = AutoConfig.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(processor_dir))
    image = json.loads((processor_dir / "preprocessor_config.json").read_text("utf-8"))

    assert config.model_type == family
    assert type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    assert config.text_config.vocab_size == len(tokenizer)
    for name, token in TOKENS.items():
        assert getattr(config, name) == tokenizer.convert_tokens_to_ids(token)
    assert config.vision_config.patch_size == image["patch_size"]
    assert config.vision_config.spatial_merge_size == image["merge_size"]
    assert config.vision_config.temporal_patch_size == image["temporal_patch_size"]
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert (out / "generation_config.json").is_file()
    assert not any(out.glob("*.safetensors"))  # config only: random init at train time


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown example family"):
        tiny_model_config("llava", tmp_path)


def test_prep_example_writes_the_model_config(example_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(example_dir / "model"))
    processor = json.loads((example_dir / "processor" / "config.json").read_text("utf-8"))
    assert config.model_type == processor["model_type"]
    assert config.image_token_id == processor["image_token_id"]
