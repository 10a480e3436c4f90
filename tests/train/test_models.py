"""`load_model`: seeded random init from a config, weights when present, text-only models packed."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from transformers import JambaConfig, Qwen2Config

from families.processor import load_processor
from tests.train.models import CONVERSATIONS, make_family, pack_samples, process, reference, scatter_truth
from train.attention import prepare_model_for_packing
from train.encoder import PackEncoder
from train.forward import packed_forward
from train.linear_attention import UnsupportedLinearAttentionError, linear_attention_layers
from train.loss import per_token_losses
from train.models import ModelLoadError, load_model


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    return make_family("qwen2_vl", tmp_path_factory.mktemp("models"))


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_config_only_init_depends_on_the_seed_alone(family) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = state(load_model(family.model_dir, seed=7, attn_implementation="packvlm_varlen"))
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is untouched
    second = state(load_model(family.model_dir, seed=7, attn_implementation="packvlm_varlen"))
    other = state(load_model(family.model_dir, seed=8, attn_implementation="packvlm_varlen"))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_a_directory_with_weights_loads_them(family, tmp_path: Path) -> None:
    model = load_model(family.model_dir, seed=3, attn_implementation="packvlm_varlen")
    model.save_pretrained(tmp_path / "saved")
    loaded = load_model(tmp_path / "saved", seed=99, attn_implementation="packvlm_varlen")
    assert loaded.config._attn_implementation == "packvlm_varlen"
    saved = state(model)
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items())


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path, seed=0, attn_implementation="packvlm_varlen")


def test_uncovered_linear_attention_models_are_refused(tmp_path: Path) -> None:
    """Linear layers that are not gated delta nets (train.linear_attention) would leak state across samples."""
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UnsupportedLinearAttentionError, match="linear-attention"):
        prepare_model_for_packing(model)
    config = JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=4,
        mamba_dt_rank=4,
    )  # fmt: skip
    assert config.layer_types == ["linear_attention", "full_attention"]  # a Mamba layer: not covered
    config.save_pretrained(tmp_path / "jamba")
    with pytest.raises(UnsupportedLinearAttentionError, match="JambaForCausalLM.*JambaMambaMixer"):
        load_model(tmp_path / "jamba", seed=0, attn_implementation="packvlm_varlen")


def test_gated_delta_net_models_load_for_packing(tmp_path: Path) -> None:
    """Qwen3.5's hybrid layers are covered (proof: tests/train/families/test_qwen3_5.py)."""
    family = make_family("qwen3_5", tmp_path)
    model = load_model(family.model_dir, seed=0, attn_implementation="packvlm_varlen")
    assert [type(m).__name__ for m in linear_attention_layers(model)] == ["Qwen3_5GatedDeltaNet"]


def test_text_only_causal_lm_packs_exactly(family, tmp_path: Path) -> None:
    """A text-only model: `load_model` picks AutoModelForCausalLM, positions are [1, T]."""
    tokenizer = load_processor(str(family.processor_dir)).tokenizer
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "text")
    model = load_model(tmp_path / "text", seed=0, attn_implementation="packvlm_varlen").train()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    processor = load_processor(str(family.processor_dir)).processor
    samples = [process(processor, c) for c in CONVERSATIONS if not c.image_sizes]
    truth = reference(model, samples)
    batch = PackEncoder.from_pretrained(str(family.processor_dir), config).encode(
        pack_samples(samples, family.processor_dir)
    )
    assert batch.position_ids.shape == (1, batch.num_tokens)
    with torch.no_grad():
        losses = per_token_losses(packed_forward(model, batch), batch.labels)
    expected = scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)
    assert float((losses[0] - expected).abs().max()) <= 1e-5
