"""Packed rows through hybrid models: gated delta nets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), short convs (LFM2).

A gated delta net mixes tokens twice without attention: a causal depthwise conv1d (4 taps) over
the fused q/k/v projection, then the gated delta recurrence. In a packed row both must restart at
every slot of ``cu_seqlens``: the conv sees zeros before a sample's first token (never the last
three tokens of the previous sample) and the recurrence starts each sample from a zero state.

transformers 5.x already hands the boundaries over: ``<Model>GatedDeltaNet.forward`` calls the
module-level ``causal_conv1d_fn(..., **kwargs)`` (``kwargs`` carry ``cu_seq_lens_q``) and
``torch_chunk_gated_delta_rule(..., cu_seqlens=kwargs.pop("cu_seq_lens_q"))``. Both are
``use_kernel_func_from_hub_with_fallback`` wrappers: with ``causal-conv1d`` installed the conv's
keywords are filtered to its signature (no boundaries: the conv leaks); without a package the
torch fallback runs (5.24 refuses ``cu_seqlens`` there, older releases ignored it). We hook in at
the same names: :func:`install_packed_linear_attention` replaces those two module globals of each
covered modeling module by a dispatcher that

    no boundaries in the call          transformers' own function, the call unchanged
    boundaries, CUDA + ``fla``         flash-linear-attention's varlen kernels (``packvlm[fla]``):
                                       ``causal_conv1d(..., cu_seqlens=)``,
                                       ``chunk_gated_delta_rule(..., cu_seqlens=)``
    boundaries, otherwise              exact: transformers' torch fallback once per slot

so the model's own layer runs unmodified, no kernel is downloaded, and an unpacked call computes
exactly what it did before. Boundaries with a cache to continue (an initial state) are refused.

LFM2's short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``: LFM2 and LFM2-VL text models,
a depthwise causal conv of ``conv_L_cache`` taps gated by the input projection) calls the same
module-level ``causal_conv1d_fn(..., **kwargs)`` with the decoder layer's ``**kwargs``, so the
same conv dispatcher makes each sample's conv start from zeros; its modeling module has no rule
function, so only the conv is hooked there.

Which layers are covered is decided here only (:func:`check_linear_layers`): every
``linear_attention`` or ``conv`` entry of the config's ``layer_types`` must be one of :data:`COVERED_LAYERS`;
any other recurrent layer (Mamba, KDA, MiniMax lightning attention, OLMo-Hybrid, ...) is refused
before training instead of leaking across samples.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from packvlm.errors import InternalError, UsageError

log = logging.getLogger(__name__)

#: token-mixing layer classes whose modeling module calls the functions hooked here (the conv; and the
#: rule where the module defines one): gated delta nets, LFM2's short convolutions
COVERED_LAYERS = frozenset(
    {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "Lfm2ShortConv", "Lfm2MoeShortConv"}
)
#: ``layer_types`` entries of recurrent / convolutional token mixers (each must be a covered layer)
LINEAR_LAYER_TYPES = frozenset({"linear_attention", "conv"})
CONV_FUNCTION = "causal_conv1d_fn"
RULE_FUNCTION = "torch_chunk_gated_delta_rule"
_HOOK_FLAG = "_packvlm_linear_attention"


class PackedLinearAttentionError(InternalError, ValueError):
    """Boundaries a linear-attention layer cannot honour (batch > 1, wrong length, a cache to continue)."""


class UnsupportedLinearAttentionError(UsageError, NotImplementedError):
    """A model with linear-attention layers that neither packed path keeps apart per sample."""


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's covered linear token mixers (gated delta nets, short convs), in module order."""
    return [m for m in model.modules() if type(m).__name__ in COVERED_LAYERS]


def _layer_types(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", config)
    return list(getattr(text_config, "layer_types", None) or ())


def check_linear_layers(model: nn.Module) -> list[nn.Module]:
    """The covered linear layers of ``model``; raises if any ``linear_attention`` layer is not one.

    Raises:
        UnsupportedLinearAttentionError: the config declares more ``linear_attention`` layers
            than the model holds covered gated-delta-net modules.
    """
    declared = sum(t in LINEAR_LAYER_TYPES for t in _layer_types(model))
    covered = linear_attention_layers(model)
    if declared > len(covered):
        mixers = sorted({type(m).__name__ for m in model.modules() if _is_token_mixer(m)} - COVERED_LAYERS)
        raise UnsupportedLinearAttentionError(
            f"{type(model).__name__}: {declared} linear-attention layers in its config, {len(covered)} of them "
            f"token mixers packvlm resets per sample ({', '.join(sorted(COVERED_LAYERS))}); the others "
            f"({', '.join(mixers) or 'unknown layer types'}) would carry state from one packed sample into the "
            "next. Train it unpacked."
        )
    return covered


def _is_token_mixer(module: nn.Module) -> bool:
    """A guess for the refusal message only: recurrent token mixers are named like these."""
    name = type(module).__name__
    parts = ("DeltaNet", "Mamba", "Mixer", "LinearAttention", "Recurrent", "Kda", "Lightning", "SSM", "ShortConv")
    return any(part in name for part in parts) and not name.endswith(("DecoderLayer", "Model", "ForCausalLM"))


def install_packed_linear_attention(model: nn.Module) -> nn.Module:
    """Refuse uncovered linear layers, then hook the covered layers' modeling modules (idempotent)."""
    for module_name in sorted({type(layer).__module__ for layer in check_linear_layers(model)}):
        _hook_module(sys.modules[module_name])
    return model


def _hook_module(modeling: Any) -> None:
    """Hook the conv, and the rule where the module has one (LFM2's modules have a conv only)."""
    conv, rule = getattr(modeling, CONV_FUNCTION), getattr(modeling, RULE_FUNCTION, None)
    if not getattr(conv, _HOOK_FLAG, False):
        setattr(modeling, CONV_FUNCTION, _conv_dispatcher(conv))
    if rule is not None and not getattr(rule, _HOOK_FLAG, False):
        setattr(modeling, RULE_FUNCTION, _rule_dispatcher(rule))


def _slots(cu: torch.Tensor, total: int, batch: int) -> list[tuple[int, int]]:
    """Non-empty ``[start, end)`` slots of ``cu`` over a row of ``total`` tokens (one host sync)."""
    bounds = [int(x) for x in cu.tolist()]
    if batch != 1:
        raise PackedLinearAttentionError(f"packed linear attention needs batch 1, got {batch} rows")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise PackedLinearAttentionError(
            f"cu_seqlens {bounds[:8]}{'...' if len(bounds) > 8 else ''} does not split {total} tokens into "
            "ordered slots (a cache in a packed forward?)"
        )
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@functools.cache
def fla_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """flash-linear-attention's (varlen causal conv1d, chunked gated delta rule), or None if absent."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:  # installed but broken (no triton, wrong torch): say so once
        log.warning("flash-linear-attention is installed but does not import (%s); packed rows run per sample", error)
        return None
    return causal_conv1d, chunk_gated_delta_rule


def _use_fla(tensor: torch.Tensor) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    if not tensor.is_cuda:
        return None
    kernels = fla_kernels()
    if kernels is None:
        _warn_slow_path()
    return kernels


@functools.cache
def _warn_slow_path() -> None:
    log.warning(
        "packed gated delta net on CUDA without flash-linear-attention: exact but one torch call per sample; "
        "pip install 'packvlm[fla]' for the varlen kernels"
    )


def segmentwise_conv1d(
    torch_conv: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu: torch.Tensor,
) -> torch.Tensor:
    """transformers' torch conv on each slot of ``hidden_states`` ``[1, D, T]`` (zeros before each start)."""
    slots = _slots(cu, hidden_states.shape[-1], hidden_states.shape[0])
    parts = [torch_conv(hidden_states[..., a:b], weight, bias, activation=activation) for a, b in slots]
    return torch.cat(parts, dim=-1)


def segmentwise_rule(
    torch_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    arguments: dict[str, Any],
    cu: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' torch chunked rule on each slot, each from a zero state; final states ``[N, H, K, V]``."""
    query = arguments["query"]
    slots = _slots(cu, query.shape[1], query.shape[0])
    per_token = ("query", "key", "value", "g", "beta")
    outputs, states = [], []
    for a, b in slots:
        out, state = torch_rule(**{**arguments, **{k: arguments[k][:, a:b] for k in per_token}})
        outputs.append(out)
        if state is not None:
            states.append(state)
    return torch.cat(outputs, dim=1), (torch.cat(states) if states else None)


def _conv_dispatcher(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    torch_conv = inspect.unwrap(original)  # transformers' torch fallback under the hub wrapper

    @functools.wraps(original)
    def causal_conv1d_fn(
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
        if cu is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        fla = _use_fla(hidden_states)
        if fla is None:
            return segmentwise_conv1d(torch_conv, hidden_states, weight, bias, activation, cu)
        _slots(cu, hidden_states.shape[-1], hidden_states.shape[0])
        out, _ = fla[0](
            x=hidden_states.transpose(1, 2),
            weight=weight,
            bias=bias,
            activation=activation,
            cu_seqlens=cu.to(device=hidden_states.device, dtype=torch.long),
        )
        return out.transpose(1, 2)

    setattr(causal_conv1d_fn, _HOOK_FLAG, True)
    return causal_conv1d_fn


def _rule_dispatcher(
    original: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    torch_rule = inspect.unwrap(original)
    signature = inspect.signature(torch_rule)

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cu = kwargs.get("cu_seqlens")
        if cu is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k != "cu_seqlens"})
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != "kwargs"}
        if arguments.get("initial_state") is not None:
            raise PackedLinearAttentionError("a packed row starts every sample from a zero state; no cache to continue")
        fla = _use_fla(arguments["query"])
        if fla is None:
            return segmentwise_rule(torch_rule, arguments, cu)
        return _fla_rule(fla[1], arguments, cu)

    setattr(torch_chunk_gated_delta_rule, _HOOK_FLAG, True)
    return torch_chunk_gated_delta_rule


def _fla_rule(
    chunk_gated_delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    arguments: dict[str, Any],
    cu: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's varlen chunked rule; key heads repeated to the value heads as transformers' fallback does."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    _slots(cu, query.shape[1], query.shape[0])
    repeat = value.shape[2] // key.shape[2]
    if repeat > 1:
        query, key = (t.repeat_interleave(repeat, dim=2) for t in (query, key))
    return chunk_gated_delta_rule(
        query,
        key,
        value,
        g=arguments["g"],
        beta=arguments["beta"],
        initial_state=None,
        output_final_state=bool(arguments.get("output_final_state")),
        use_qk_l2norm_in_kernel=bool(arguments.get("use_qk_l2norm_in_kernel")),
        cu_seqlens=cu.to(device=query.device, dtype=torch.long),
    )
