"""Gemma 3's packed attention rule (`train.block_attention`) against transformers' own masks (CPU).

The truth is transformers 5.x itself: for every sample alone, ``modeling_gemma3``'s
``create_masks_for_vision_model`` (blocks from ``token_type_ids`` by
``get_block_sequence_ids_for_mask``, sdpa masks materialised), placed block-diagonally in the
row. Random layouts mix text-only samples, samples with one and several image blocks (blocks
touching the slot's start and end), pad tokens at the end of slots, and windows shorter and
longer than the blocks. Checked against it: the rule itself (:func:`allowed` over the whole
grid), the flex ``mask_mod`` evaluated by ``create_block_mask`` (uncompiled) and
``flex_attention`` run on CPU (unfused, forward only: no CPU backward in torch 2.13), the per-slot SDPA reference, and
``packvlm_varlen`` called the way the model calls it. The CUDA path (compiled flex) is the
same ``mask_mod``; it is not run here.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

from train.attention import packed_attention_forward
from train.block_attention import (
    IMAGE_BLOCKS_KWARG,
    ImageBlockRule,
    allowed,
    flex_attention_forward,
    flex_available,
    reference_attention,
)

WINDOWS = (None, 1, 3, 16)


def random_layout(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Per sample: token types (1 = image token, runs separated by text) and slot padding."""
    samples, pads = [], []
    for _ in range(rng.randint(1, 5)):
        types: list[int] = []
        for _ in range(rng.randint(0, 3)):  # image blocks of this sample
            types += [0] * rng.choice([0, 1, 2, 7]) + [1] * rng.randint(1, 12)
            if rng.random() < 0.8:
                types.append(0)  # text between / after blocks (else a block may end the sample)
        types += [0] * rng.randint(0 if types else 1, 20)
        samples.append(types)
        pads.append(rng.choice([0, 0, 3]))
    return samples, pads


def hf_masks(types: list[int], window: int) -> dict[str, torch.Tensor]:
    """transformers' masks for one sample alone: {"full_attention", "sliding_attention"} -> bool [L, L]."""
    config = Gemma3TextConfig(sliding_window=window, num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    config._attn_implementation = "sdpa"
    token_type_ids = torch.tensor([types])
    masks = create_masks_for_vision_model(
        config=config,
        inputs_embeds=torch.zeros(1, len(types), 4),
        attention_mask=torch.ones(1, len(types), dtype=torch.long),
        cache=None,
        position_ids=None,
        block_sequence_ids=get_block_sequence_ids_for_mask(token_type_ids),
    )
    return {k: v[0, 0] for k, v in masks.items()}


def truth_and_rule(
    samples: list[list[int]], pads: list[int], window: int | None
) -> tuple[torch.Tensor, ImageBlockRule]:
    """The dense row truth [T, T] (pads: causal inside their slot) and the rule from slots + spans."""
    total = sum(len(s) + p for s, p in zip(samples, pads))
    truth = torch.zeros(total, total, dtype=torch.bool)
    bounds, spans, start = [0], [], 0
    for types, pad in zip(samples, pads):
        length = len(types) + pad
        padded = types + [0] * pad  # pad tokens are text at the slot's end
        masks = hf_masks(padded, window or 1)
        truth[start : start + length, start : start + length] = masks[
            "full_attention" if window is None else "sliding_attention"
        ]
        hit = torch.tensor([0, *padded, 0])
        edges = (hit[1:] != hit[:-1]).nonzero().view(-1).tolist()
        spans += [(start + a, start + b) for a, b in zip(edges[::2], edges[1::2])]
        start += length
        bounds.append(start)
    rule = ImageBlockRule.build(
        torch.tensor(bounds, dtype=torch.int32),
        torch.tensor(spans, dtype=torch.int32).reshape(-1, 2),
        total,
        compile=False,
    )
    return truth, rule


def layouts(count: int = 12) -> list[tuple[list[list[int]], list[int]]]:
    rng = random.Random(18)
    return [random_layout(rng) for _ in range(count)]


@pytest.mark.parametrize("window", WINDOWS)
def test_rule_equals_transformers_masks_on_random_layouts(window: int | None) -> None:
    for samples, pads in layouts():
        truth, rule = truth_and_rule(samples, pads, window)
        index = torch.arange(truth.shape[0])
        got = allowed(index[:, None], index[None, :], rule.slots, rule.blocks, window)
        assert torch.equal(got, truth)
        for a, b in rule.segments:  # the per-slot masks of the CPU reference
            assert torch.equal(rule.dense(a, b, window), truth[a:b, a:b])


def test_rule_example_of_the_module_docstring() -> None:
    rule = ImageBlockRule.build(torch.tensor([0, 5, 14]), torch.tensor([[8, 12]]), 14, compile=False)
    row = lambda q, window: rule.dense(0, 14, window)[q].nonzero().view(-1).tolist()  # noqa: E731
    assert row(9, 3) == [7, 8, 9, 10, 11] and row(9, None) == [5, 6, 7, 8, 9, 10, 11]
    assert row(13, 3) == [11, 12, 13] and row(13, None) == list(range(5, 14))


@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
@pytest.mark.parametrize("window", [None, 3])
def test_flex_mask_mod_and_block_mask_equal_the_truth(window: int | None) -> None:
    """The mask_mod as flex evaluates it (vmapped by create_block_mask) gives the dense truth."""
    from torch.nn.attention.flex_attention import create_mask

    for samples, pads in layouts(4):
        truth, rule = truth_and_rule(samples, pads, window)
        total = truth.shape[0]
        dense = create_mask(rule.mask_mod(window), None, None, total, total, device="cpu")
        assert torch.equal(dense[0, 0], truth)
        block_mask = rule.block_mask(window, torch.device("cpu"))
        assert rule.block_mask(window, torch.device("cpu")) is block_mask  # built once per row and window
        assert tuple(block_mask.shape[-2:]) == (total, total)


def random_qkv(total: int, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(total)
    return tuple(torch.randn(1, h, total, dim, generator=generator) for h in (heads, kv_heads, kv_heads))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=truth, scale=0.3, enable_gqa=True)


@pytest.mark.parametrize("window", [None, 3, 16])
def test_reference_attention_equals_dense_masked_sdpa(window: int | None) -> None:
    for samples, pads in layouts(6):
        truth, rule = truth_and_rule(samples, pads, window)
        q, k, v = random_qkv(truth.shape[0])
        got = reference_attention(q, k, v, rule, window=window, scaling=0.3, dropout=0.0)
        assert float((got - dense_attention(q, k, v, truth)).abs().max()) <= 1e-6


@pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
@pytest.mark.parametrize("window", [None, 3])
def test_flex_attention_on_cpu_equals_dense_masked_sdpa(window: int | None) -> None:
    """The CUDA code path run on CPU, uncompiled (unfused); forward only (flex has no CPU backward)."""
    for samples, pads in layouts(3):
        truth, rule = truth_and_rule(samples, pads, window)
        q, k, v = random_qkv(truth.shape[0])
        got = flex_attention_forward(q, k, v, rule, window=window, scaling=0.3)
        assert float((got - dense_attention(q, k, v, truth)).abs().max()) <= 1e-5


@pytest.mark.parametrize("window", [None, 16])
def test_packvlm_varlen_applies_the_rule_as_a_model_calls_it(window: int | None) -> None:
    samples, pads = layouts(2)[1]
    truth, rule = truth_and_rule(samples, pads, window)
    q, k, v = random_qkv(truth.shape[0])
    cu = torch.tensor([a for a, _ in rule.segments] + [truth.shape[0]], dtype=torch.int32)
    module = SimpleNamespace(is_causal=True, training=False)
    out, _ = packed_attention_forward(
        module,  # type: ignore[arg-type]
        q, k, v, None, scaling=0.3, sliding_window=window,
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=64, max_length_k=64, **{IMAGE_BLOCKS_KWARG: rule},
    )  # fmt: skip
    assert float((out.transpose(1, 2) - dense_attention(q, k, v, truth)).abs().max()) <= 1e-6


@pytest.mark.parametrize("mutation", ["causal_blocks", "blocks_see_next_image", "no_window"])
def test_mutated_rules_differ_from_transformers(mutation: str) -> None:
    """The truth can tell each wrong rule apart on these layouts (the mutations the model test runs)."""
    samples, pads = [[0, 0, 1, 1, 1, 0, 1, 1, 0, 0] + [0] * 20], [0]
    window = 3
    truth, rule = truth_and_rule(samples, pads, window)
    index = torch.arange(truth.shape[0])
    q, kv = index[:, None], index[None, :]
    if mutation == "causal_blocks":
        got = allowed(q, kv, rule.slots, torch.full_like(rule.blocks, -1), window)
    elif mutation == "blocks_see_next_image":
        got = allowed(q, kv, rule.slots, torch.where(rule.blocks >= 0, 0, -1), window)
    else:
        got = allowed(q, kv, rule.slots, rule.blocks, None)
    assert not torch.equal(got, truth)
