"""Every example family's tiny model accepts what its own example processor gives.

Oracles: the real HF processor (loaded as packvlm loads it, ``load_processor``; "pieces" where
the video processor needs torchvision) on a conversation with two images of different sizes
and on a text-only one, and the model's own checks in an unpacked forward: image features
must number exactly the image placeholder tokens (``get_placeholder_mask``), grids and tiles
must fit the vision tower. Removing one placeholder token must make that check fail.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedModel, ProcessorMixin
from transformers.image_utils import load_image
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from families.example.model import TinyModel
from families.processor import ProcessorBundle, load_processor
from families.registry import example_families, example_family
from prep.example.media import make_image_bytes
from prep.example.model import tiny_model_config, write_tiny_model
from train.models import has_weights, load_model

FAMILIES = example_families()
IMAGE_SIZES = ((112, 84), (84, 56))  # (width, height): two images of different sizes
STRING_REPLIES = {"pixtral"}
# Gemma3Processor.image_token is the placeholder its template writes (<start_of_image>, the model's
# boi token); each image expands to <image_soft_token> x image_seq_length, the token the model fills.
EXPANDED_IMAGE_TOKEN = {
    "gemma3": "<image_soft_token>"
}  # pixtral-12b's template appends the reply content to eos_token: a string
# model type of each family's tiny config (Omni: the thinker; Pixtral: a LLaVA checkpoint)
MODEL_TYPES = {
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "glm46v": "glm46v",
    "glm4v": "glm4v",
    "idefics3": "idefics3",
    "internvl": "internvl",
    "lfm2_vl": "lfm2_vl",
    "llava_next": "llava_next",
    "llava_onevision": "llava_onevision",
    "minicpmv4_6": "minicpmv4_6",
    "mistral3": "mistral3",
    "paddleocr_vl": "paddleocr_vl",
    "pixtral": "llava",
    "qwen2_5_omni": "qwen2_5_omni_thinker",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_vl": "qwen2_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_omni_moe": "qwen3_omni_moe_thinker",
    "qwen3_vl": "qwen3_vl",
    "smolvlm": "smolvlm",
    "kimi_k25": "kimi_k25",
}


@dataclass(frozen=True)
class Built:
    processor_dir: Path
    model_dir: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        family = example_family(name)
        processor_dir = family.build_processor(root / name / "processor")
        assert family.build_model is not None, name
        out[name] = Built(processor_dir, family.build_model(root / name / "model", processor_dir))
    return out


def _model(model_dir: Path) -> PreTrainedModel:
    """What `train hf` loads; where packing is refused (Qwen3.5's linear attention), the same class unpacked."""
    try:
        return load_model(model_dir, seed=0, attn_implementation="sdpa").train()
    except NotImplementedError:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
        return model.train()


def _inputs(bundle: ProcessorBundle, family: str, sizes: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """The real processor on one user turn (images, then text) and the reply, as packvlm calls it."""
    processor: Any = bundle.processor
    reply = "The first one is wider."
    messages = [
        {"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": reply if family in STRING_REPLIES else [{"type": "text", "text": reply}]},
    ]
    # the base method: SmolVLMProcessor's own override reads its (absent, torchvision-only) video processor
    text = ProcessorMixin.apply_chat_template(processor, messages, tokenize=False)
    images = [load_image(Image.open(io.BytesIO(make_image_bytes(w, h, seed=w)))) for w, h in sizes]
    inputs = dict(processor(text=[text], images=images or None, return_tensors="pt"))
    inputs.pop("attention_mask")
    return inputs


def _loss(model: PreTrainedModel, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, attention_mask=None, use_cache=False, labels=inputs["input_ids"]).loss


def test_every_family_has_a_tiny_model() -> None:
    lacking = [name for name in FAMILIES if not isinstance(example_family(name).build_model, TinyModel)]
    assert not lacking, f"example families without a tiny model config: {lacking}"
    assert set(FAMILIES) == set(MODEL_TYPES)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_accepts_the_real_processor_output(family: str, built: dict[str, Built]) -> None:
    bundle = load_processor(str(built[family].processor_dir))
    assert bundle.processor is not None
    model = _model(built[family].model_dir)
    config, tokenizer = model.config, bundle.tokenizer
    assert config.model_type == MODEL_TYPES[family]
    assert type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    # the class that was built is the one config.json names (Megatron-Bridge's AutoBridge needs it)
    written = json.loads((built[family].model_dir / "config.json").read_text())
    assert written["architectures"] == [type(model).__name__]
    image_token_id = tokenizer.convert_tokens_to_ids(EXPANDED_IMAGE_TOKEN.get(family, bundle.processor.image_token))
    assert config.image_token_id == image_token_id
    assert config.get_text_config().vocab_size == len(tokenizer)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)

    with_images = _inputs(bundle, family, IMAGE_SIZES)
    placeholders = with_images["input_ids"] == image_token_id
    assert placeholders.sum() > 0
    assert torch.isfinite(_loss(model, with_images))  # the model's count and shape checks passed
    text_only = _inputs(bundle, family, ())
    assert not (text_only["input_ids"] == image_token_id).any()
    assert torch.isfinite(_loss(model, text_only))

    # one placeholder fewer than image features: the model's own check must refuse it
    last = int(placeholders[0].nonzero()[-1])
    with_images["input_ids"] = with_images["input_ids"].clone()
    with_images["input_ids"][0, last] = tokenizer.pad_token_id
    with pytest.raises(ValueError, match="tokens do not match"):  # MiniCPM-V: "Multimodal features and tokens ..."
        _loss(model, with_images)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_arguments_same_bytes(family: str, built: dict[str, Built], tmp_path: Path) -> None:
    first = built[family].model_dir
    again = write_tiny_model(tmp_path / "model", family, built[family].processor_dir)
    assert sorted(p.name for p in again.iterdir()) == ["config.json", "generation_config.json"]
    for name in ("config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    config = tiny_model_config(family, built[family].processor_dir)
    assert config.to_json_string(use_diff=True) == (first / "config.json").read_text("utf-8")
    assert not has_weights(first)  # config only: random init at train time


def test_gemma3_has_a_small_window_and_a_global_layer(built: dict[str, Built]) -> None:
    text = AutoConfig.from_pretrained(str(built["gemma3"].model_dir)).text_config
    assert text.layer_types == ["sliding_attention", "full_attention"]
    assert text.sliding_window == 16
    processor: Any = load_processor(str(built["gemma3"].processor_dir)).processor
    config = AutoConfig.from_pretrained(str(built["gemma3"].model_dir))
    assert config.mm_tokens_per_image == processor.image_seq_length
    assert config.boi_token_id == processor.image_token_id  # <start_of_image>


def test_kimi_k25_is_a_deepseek_v3_moe_with_the_processors_merge(built: dict[str, Built]) -> None:
    config = AutoConfig.from_pretrained(str(built["kimi_k25"].model_dir))
    text, vision = config.text_config, config.vision_config
    assert (text.model_type, text.n_routed_experts, text.num_experts_per_tok, text.first_k_dense_replace) == (
        "deepseek_v3",
        4,
        2,
        1,
    )
    image = json.loads((built["kimi_k25"].processor_dir / "preprocessor_config.json").read_text())
    assert vision.patch_size == image["patch_size"] and list(vision.merge_kernel_size) == [image["merge_size"]] * 2
    assert config.projection_hidden_size == vision.hidden_size


def test_qwen3_5_is_a_linear_and_full_attention_hybrid(built: dict[str, Built]) -> None:
    text = AutoConfig.from_pretrained(str(built["qwen3_5"].model_dir)).text_config
    assert text.layer_types == ["linear_attention", "full_attention"]
    assert (text.linear_num_key_heads, text.linear_key_head_dim, text.linear_value_head_dim) == (2, 8, 8)
