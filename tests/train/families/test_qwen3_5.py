"""Qwen3.5 (hybrid gated delta net + gated full attention) packed: equal to each sample alone (CPU, fp32).

The tiny random model of ``prep example --family qwen3_5`` (one ``linear_attention`` layer, one
``full_attention`` layer; 2 key / 4 value linear heads, 4-tap conv) sees packs built the way
`prep pack` stores them from the real ``Qwen3VLProcessor`` outputs of text-only, one-image and
two-image conversations. The truth is each conversation alone through the model with
transformers' *own* module functions (``unmodified_transformers``: the hooks of
`train.linear_attention` taken out) and stock SDPA.

Mutations that must fail, each alone: the causal conv1d run over the whole row (the previous
sample's last 3 tokens leak into the next), the delta-rule state carried across samples. At the
layer level (every covered class: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) the packed-then-sliced
output equals each segment alone, and NeMo Automodel's bug (neither reset) is reproduced as a
mutation. The FLA call is checked for its plumbing against a stand-in with FLA's signature and
layout; the kernels themselves run only in the ``gpu`` test (CUDA + flash-linear-attention).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from tests.train.families.harness import (
    LARGE,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    assert_restarting_positions,
    assert_slots,
    build_setup,
    loss_diff,
    split_pack,
    varlen_losses,
)
from tests.train.models import CONVERSATIONS, Sample, Truth, reference
from train import linear_attention
from train.attention import prepare_model_for_packing
from train.batch import PackedBatch
from train.forward import packed_inputs
from train.linear_attention import (
    CONV_FUNCTION,
    RULE_FUNCTION,
    PackedLinearAttentionError,
    UnsupportedLinearAttentionError,
    install_packed_linear_attention,
    linear_attention_layers,
)


@contextlib.contextmanager
def unmodified_transformers(modules: set[Any]) -> Iterator[None]:
    """transformers' own ``causal_conv1d_fn`` / ``torch_chunk_gated_delta_rule`` back in ``modules``."""
    with contextlib.ExitStack() as stack:
        for modeling in modules:
            for name in (CONV_FUNCTION, RULE_FUNCTION):
                hooked = getattr(modeling, name)
                original = (
                    getattr(hooked, "__wrapped__", hooked) if hasattr(hooked, "_packvlm_linear_attention") else hooked
                )
                assert original.__module__ == modeling.__name__ and not hasattr(original, "_packvlm_linear_attention")
                stack.enter_context(mock.patch.object(modeling, name, original))
        yield


def modeling_modules(model: nn.Module) -> set[Any]:
    return {sys.modules[type(layer).__module__] for layer in linear_attention_layers(model)}


def whole_row_conv(torch_conv, hidden_states, weight, bias, activation, cu):  # noqa: ANN001, ANN201
    """Mutation: the conv over the whole row, as transformers' fallback does (boundaries ignored)."""
    return torch_conv(hidden_states, weight, bias, activation=activation)


def whole_row_rule(torch_rule, arguments, cu):  # noqa: ANN001, ANN201
    """Mutation: one recurrence over the whole row (the state carried from sample to sample)."""
    return torch_rule(**arguments)


# --- the model: packed forward vs each sample alone --------------------------------------------


def long_memory(model: nn.Module) -> None:
    """Make a leak visible at the loss, as in trained checkpoints' slow heads.

    transformers' init (``A`` up to 16: the state decays by ~e^-20 per token; projections and
    conv taps of std 0.02) makes the tiny model forget a sample within a token, so a carried
    state moves the losses by ~3e-6 and a leaking conv by ~1.4e-3 only. With ``A`` in [0.01, 0.1]
    (a decay of 0.87-0.99 per token) and conv taps of std 0.5 the mutations move them by 7e-2
    and 2.6e-2; the truth is computed with these weights.
    """
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in linear_attention_layers(model):
            layer.conv1d.weight.normal_(0.0, 0.5, generator=generator)
            layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.1, generator=generator).log())


def prepare_long_memory(model: PreTrainedModel) -> None:
    """The fixture's weights: load_model -> prepare_model_for_packing put the hooks in; long memory."""
    assert [type(m).__name__ for m in linear_attention_layers(model)] == ["Qwen3_5GatedDeltaNet"]
    long_memory(model)


def own_reference(model: PreTrainedModel, samples: list[Sample]) -> Truth:
    """The truth with transformers' own linear attention (the hooks taken out)."""
    with unmodified_transformers(modeling_modules(model)):
        return reference(model, samples)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("qwen3_5")
    packs = {"A": CONVERSATIONS}
    return build_setup("qwen3_5", root, packs, vision="visual", prepare=prepare_long_memory, truth=own_reference)


def packed_diff(setup: Setup, batch: PackedBatch, order: tuple[int, ...] = (0, 1, 2, 3), **overrides: object) -> float:
    """Largest |packed - alone| of the varlen path over a row of the samples in ``order``."""
    truth = Truth([setup.truth["A"].losses[i] for i in order], {})
    return loss_diff(truth, batch, varlen_losses(setup, batch, **overrides))


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = setup.encode("A", pad_to_multiple_of)
    assert_slots(batch, setup.samples["A"], pad_to_multiple_of)
    assert_restarting_positions(batch, rows=4)
    assert batch.image_grid_thw.shape[0] == sum(len(c.image_sizes) for c in CONVERSATIONS) == 3
    packed = assert_equals_alone(setup, batch, "A")
    linear = [n for n in packed if ".linear_attn." in n]
    assert {n.rsplit(".", 2)[-2] for n in linear} >= {"conv1d", "in_proj_qkv", "out_proj"}
    assert all(float(packed[n].abs().max()) > 0 for n in linear if not n.endswith("dt_bias"))


def test_two_packs_per_micro_batch(setup: Setup) -> None:
    """``--packs-per-microbatch 2``: boundaries continue across the joined packs."""
    batch = split_pack(setup, "A", (2, 0), (1, 3), pads=(16, 1))
    assert packed_diff(setup, batch, (2, 0, 1, 3)) <= TOLERANCE


def test_mutation_conv_not_reset_mixes_samples(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = setup.encode("A")
    monkeypatch.setattr(linear_attention, "segmentwise_conv1d", whole_row_conv)
    assert packed_diff(setup, batch) > LARGE


def test_mutation_state_not_reset_mixes_samples(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = setup.encode("A")
    monkeypatch.setattr(linear_attention, "segmentwise_rule", whole_row_rule)
    assert packed_diff(setup, batch) > LARGE


def test_a_cache_in_the_packed_call_is_harmless(setup: Setup) -> None:
    """``use_cache=True`` (a fresh cache: per-sample final states are returned, no state is
    continued) computes the same packed losses; `packed_forward` still passes False."""
    batch = setup.encode("A")
    assert packed_inputs(setup.model, batch)["use_cache"] is False
    assert packed_diff(setup, batch, use_cache=True) <= TOLERANCE


def test_unpacked_calls_are_transformers_own(setup: Setup) -> None:
    """Without boundaries the hooked functions pass the call through: bit-identical logits."""
    sample = setup.samples["A"][2]
    inputs = {**sample.inputs, "attention_mask": torch.ones_like(sample.input_ids), "use_cache": False}
    with torch.no_grad():
        hooked = setup.model(**inputs).logits
        with unmodified_transformers(modeling_modules(setup.model)):
            own = setup.model(**inputs).logits
    assert torch.equal(hooked, own)


# --- the layer: packed-then-sliced vs each segment alone ---------------------------------------

LENGTHS = (5, 70, 1, 9, 66)  # crosses the 64-token chunk of the delta rule, a one-token sample
LINEAR_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "layer_types": ["linear_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
LAYERS = {
    "qwen3_5": ("Qwen3_5TextConfig", "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "Qwen3_5MoeGatedDeltaNet",
    ),
    "qwen3_next": ("Qwen3NextConfig", "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
}


def make_layer(name: str) -> nn.Module:
    import importlib

    import transformers

    config_class, module, layer_class = LAYERS[name]
    config = getattr(transformers, config_class)(**LINEAR_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = getattr(importlib.import_module(module), layer_class)(config, layer_idx=0)
        nn.init.normal_(layer.conv1d.weight, std=0.5)  # a conv that visibly mixes its 4 taps
    return install_packed_linear_attention(layer)


def segments_alone(layer: nn.Module, hidden: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Each segment through the unmodified layer, outputs concatenated along the row."""
    bounds = cu.tolist()
    with unmodified_transformers({sys.modules[type(layer).__module__]}):
        return torch.cat([layer(hidden[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)


@pytest.fixture(params=sorted(LAYERS))
def layer_case(request: pytest.FixtureRequest) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layer = make_layer(request.param)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, sum(LENGTHS), LINEAR_CONFIG["hidden_size"], generator=generator)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return layer, hidden, cu


def packed_call(layer: nn.Module, hidden: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The layer as the decoder calls it in `packed_forward` (the varlen keywords in ``kwargs``)."""
    length = int(cu.diff().max())
    return layer(hidden, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=length, max_length_k=length)


def test_layer_packed_then_sliced_equals_segments_alone(layer_case) -> None:  # noqa: ANN001
    """In float64, so the claim holds at any thread count: in fp32 the packed row's projections
    and conv run over other shapes than each segment's, and gradient entries moved by up to 2.5e-5
    relative on 2 threads of an AMD EPYC. In float64 only transformers' own fp32 islands (the delta
    rule's torch fallback computes in fp32) differ: an input rounding to the neighbouring fp32
    value moves an entry by ~1 fp32 ulp (6e-8); measured 5.2e-8 at 1 and 2 threads, 200x inside
    TOLERANCE, while a leak between segments moves outputs by > LARGE."""
    layer, hidden, cu = layer_case
    layer, hidden = layer.double(), hidden.double().requires_grad_()
    packed = packed_call(layer, hidden, cu)
    alone = segments_alone(layer, hidden, cu)
    assert float((packed - alone).detach().abs().max()) <= TOLERANCE
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((packed * weights).sum(), [hidden, *layer.parameters()])
    truth = torch.autograd.grad((alone * weights).sum(), [hidden, *layer.parameters()])
    assert max(float(((g - t).abs() / (1 + t.abs())).max()) for g, t in zip(grads, truth)) <= TOLERANCE


@pytest.mark.parametrize(
    ("conv", "rule"),
    [(whole_row_conv, None), (None, whole_row_rule), (whole_row_conv, whole_row_rule)],
    ids=["conv-not-reset", "state-not-reset", "neither-reset-nemo"],
)
def test_layer_mutations_mix_segments(layer_case, conv, rule, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    layer, hidden, cu = layer_case
    if conv is not None:
        monkeypatch.setattr(linear_attention, "segmentwise_conv1d", conv)
    if rule is not None:
        monkeypatch.setattr(linear_attention, "segmentwise_rule", rule)
    with torch.no_grad():
        packed, alone = packed_call(layer, hidden, cu), segments_alone(layer, hidden, cu)
    diff = (packed - alone).abs().amax(dim=(0, 2))
    assert float(diff.max()) > LARGE
    assert float(diff[: LENGTHS[0]].max()) <= TOLERANCE  # nothing comes before the first sample
    if rule is None:  # the conv's 3-token tail enters a sample at its first tokens (kernel 4)
        assert max(float(diff[start : start + 3].max()) for start in cu[1:-1].tolist()) > LARGE


def test_layer_refuses_bad_boundaries(layer_case) -> None:  # noqa: ANN001
    layer, hidden, cu = layer_case
    modeling = sys.modules[type(layer).__module__]
    heads = torch.zeros(1, 4, 2, 8)
    with pytest.raises(PackedLinearAttentionError, match="no cache to continue"):
        getattr(modeling, RULE_FUNCTION)(
            heads, heads, heads.repeat(1, 1, 2, 1), g=torch.zeros(1, 4, 4), beta=torch.ones(1, 4, 4),
            initial_state=torch.zeros(1, 4, 8, 8), cu_seqlens=torch.tensor([0, 2, 4]),
        )  # fmt: skip
    with pytest.raises(PackedLinearAttentionError, match="does not split"):
        packed_call(layer, hidden[:, :-1], cu)
    with pytest.raises(PackedLinearAttentionError, match="batch 1"):
        packed_call(layer, hidden.expand(2, -1, -1), cu)


def fla_standin(calls: list[str]) -> tuple[Any, Any]:
    """flash-linear-attention's two entry points by their documented signature and layout
    (conv: x [B, T, D], weight [D, W] -> (y [B, T, D], state); rule: q/k/v/g/beta [1, T, H, .],
    equal q/k/v heads, cu_seqlens long -> (o, state)), computed by transformers' torch functions."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    torch_conv = modeling.causal_conv1d_fn.__wrapped__
    torch_rule = modeling.torch_chunk_gated_delta_rule.__wrapped__

    def causal_conv1d(*, x, weight, bias=None, activation=None, cu_seqlens=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        assert cu_seqlens.dtype == torch.long and x.shape[0] == 1 and weight.dim() == 2 and not kwargs
        calls.append("conv")
        bounds = cu_seqlens.tolist()
        xt = x.transpose(1, 2)
        y = torch.cat(
            [torch_conv(xt[..., a:b], weight, bias, activation=activation) for a, b in zip(bounds, bounds[1:])], -1
        )
        return y.transpose(1, 2), None

    def chunk_gated_delta_rule(
        q, k, v, g, beta, *, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    ):  # noqa: ANN001, ANN202, E501
        assert q.shape[2] == k.shape[2] == v.shape[2] == g.shape[2] == beta.shape[2] and initial_state is None
        assert cu_seqlens.dtype == torch.long and use_qk_l2norm_in_kernel
        calls.append("rule")
        bounds = cu_seqlens.tolist()
        parts = [
            torch_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True)[0]
            for a, b in zip(bounds, bounds[1:])
        ]
        return torch.cat(parts, dim=1), None

    return causal_conv1d, chunk_gated_delta_rule


def test_fla_path_plumbing_against_its_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch's transposes, head repeat and keywords, with CPU stand-ins for the kernels."""
    layer = make_layer("qwen3_5")
    hidden = torch.randn(1, sum(LENGTHS), LINEAR_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    calls: list[str] = []
    monkeypatch.setattr(linear_attention, "_use_fla", lambda tensor: fla_standin(calls))
    with torch.no_grad():
        packed, alone = packed_call(layer, hidden, cu), segments_alone(layer, hidden, cu)
    assert calls == ["conv", "rule"]
    assert float((packed - alone).abs().max()) <= TOLERANCE


def test_fla_is_not_used_on_cpu() -> None:
    assert linear_attention._use_fla(torch.zeros(1)) is None


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or linear_attention.fla_kernels() is None,
    reason="needs CUDA + flash-linear-attention",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernels_equal_cpu_reference(dtype: torch.dtype) -> None:
    layer = make_layer("qwen3_5")
    hidden = torch.randn(1, sum(LENGTHS), LINEAR_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        alone = segments_alone(layer, hidden, cu)
        gpu = layer.to("cuda", dtype)
        packed = packed_call(gpu, hidden.to("cuda", dtype), cu.to("cuda")).float().cpu()
    assert float((packed - alone).abs().max()) <= (2e-3 if dtype == torch.float32 else 5e-2) * max(
        1.0, float(alone.abs().max())
    )


# --- refusal: linear layers neither path covers ------------------------------------------------


def test_partially_covered_model_is_refused() -> None:
    """A hybrid whose second linear layer is not a gated delta net packvlm knows: refused by name."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    config = Qwen3_5TextConfig(**{**LINEAR_CONFIG, "num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2})
    model = Qwen3_5TextModel(config)

    class OtherLinearMixer(nn.Module):
        def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return hidden_states

    model.layers[1].linear_attn = OtherLinearMixer()
    with pytest.raises(
        UnsupportedLinearAttentionError, match="2 linear-attention layers in its config, 1 of them.*OtherLinearMixer"
    ):
        prepare_model_for_packing(model)
