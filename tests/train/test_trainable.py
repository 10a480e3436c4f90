"""Parameter groups per family (`train.trainable`) and LoRA targets (`train.lora`), on every example family.

Truths independent of the grouping table: transformers' own accessors (``get_decoder()`` is the
language model, ``get_output_embeddings()`` the head), the shapes of the parts (the vision tower
holds the patch embedding over 3 colour channels; the projector ends in the language model's
hidden size), and the config (Omni thinkers have an audio tower).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from families.registry import example_families, example_family
from tests.train.models import make_family
from train.lora import language_linear_layers, target_modules
from train.models import load_model
from train.trainable import UngroupedParameterError, freeze, group_sizes, parameter_group, parameter_groups

FAMILIES = tuple(name for name in example_families() if example_family(name).build_model is not None)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    family = make_family(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(family.model_dir, seed=0, attn_implementation="sdpa")


def test_every_example_family_has_a_model() -> None:
    assert FAMILIES == example_families(), FAMILIES


def _text_hidden_size(model: nn.Module) -> int:
    return int(model.config.get_text_config().hidden_size)


def test_every_parameter_falls_in_exactly_one_group(model: nn.Module) -> None:
    groups = parameter_groups(model)
    named = dict(model.named_parameters())
    assert groups.keys() == named.keys()
    sizes = group_sizes(model)
    assert sum(sizes.values()) == sum(p.numel() for p in model.parameters())  # tied weights once

    language = {id(p) for p in model.get_decoder().parameters()} | {
        id(p) for p in model.get_output_embeddings().parameters()
    }
    assert {n for n, g in groups.items() if g == "language"} == {n for n, p in named.items() if id(p) in language}

    vision = {n: named[n] for n, g in groups.items() if g == "vision"}
    # a conv over RGB, or (SigLIP2 NaFlex of LFM2-VL, Gemma 4's patch_embedder) a linear over flattened RGB patches
    linear_patches = [p for n, p in vision.items() if "patch_embed" in n and p.dim() == 2 and p.shape[1] % 3 == 0]
    assert any(p.dim() >= 4 and p.shape[1] == 3 for p in vision.values()) or linear_patches, "no patch embedding"
    projector = {n: named[n] for n, g in groups.items() if g == "projector"}
    hidden = _text_hidden_size(model)
    assert any(hidden in p.shape for p in projector.values()), sorted(projector)
    audio = [n for n, g in groups.items() if g == "audio"]
    assert bool(audio) == (getattr(model.config, "audio_config", None) is not None), audio[:3]  # Gemma 4: None


def test_freeze_sets_requires_grad_on_exactly_the_group(model: nn.Module) -> None:
    try:
        frozen = freeze(model, ["vision", "projector"])
        groups = parameter_groups(model)
        for name, param in model.named_parameters():
            assert param.requires_grad == (groups[name] not in ("vision", "projector")), name
        sizes = group_sizes(model)
        assert frozen == sizes["vision"] + sizes["projector"]
    finally:
        model.requires_grad_(True)


def test_default_lora_targets_are_the_language_models_linear_layers(model: nn.Module) -> None:
    targets = target_modules(model)
    decoder = dict(model.get_decoder().named_modules())
    linear_in_layers = {id(m) for n, m in decoder.items() if isinstance(m, nn.Linear) and n.startswith("layers.")}
    modules = dict(model.named_modules())
    assert {id(modules[t]) for t in targets} == linear_in_layers
    leaf = min(t.rsplit(".", 1)[-1] for t in targets)  # q_proj, or an MLA model's kv_a_proj_with_mqa (Kimi K2.5)
    assert {t.rsplit(".", 1)[-1] for t in target_modules(model, (leaf,))} == {leaf}


def test_a_new_module_of_a_vlm_is_refused_not_guessed() -> None:
    with pytest.raises(UngroupedParameterError, match="model.sound_encoder.proj.weight"):
        parameter_group("model.sound_encoder.proj.weight")
    assert parameter_group("model.layers.0.mlp.up_proj.weight", multimodal=False) == "language"
    lora = "base_model.model.model.visual.merger.mlp.0.lora_A.default.weight"
    assert parameter_group(lora) == "projector"


def test_language_linear_layers_of_a_text_only_model() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    with torch.device("meta"):
        text_model = Qwen2ForCausalLM(config)
    assert set(parameter_groups(text_model).values()) == {"language"}
    assert len(language_linear_layers(text_model)) == 2 * 7
