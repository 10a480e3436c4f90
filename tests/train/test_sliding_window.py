"""Sliding-window layers packed with ``packvlm_varlen`` (any model): equal to each sample alone (CPU).

The truth is transformers' own sliding mask for one sample (``sliding_window_causal_mask_function``:
``kv <= q`` and ``kv > q - window``), block-diagonal over the row, through dense SDPA; and, for
a whole model, a tiny Mistral (every layer sliding) run on each sample alone with stock SDPA.
Random layouts have slots shorter and longer than the window. The CUDA kernel is torch's
varlen flash kernel with ``window_size=(window - 1, 0)``: its options are checked with a
recording stand-in here; the kernel itself runs only on a GPU (skipped without one).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from transformers import MistralConfig, MistralForCausalLM
from transformers.masking_utils import sliding_window_causal_mask_function

from train import attention
from train.attention import packed_attention_forward

WINDOWS = (1, 4, 16)


def dense_truth(lengths: list[int], window: int) -> torch.Tensor:
    total = sum(lengths)
    truth = torch.zeros(total, total, dtype=torch.bool)
    rule = sliding_window_causal_mask_function(window)
    start = 0
    for n in lengths:
        index = torch.arange(n)
        truth[start : start + n, start : start + n] = rule(0, 0, index[:, None], index[None, :])
        start += n
    return truth


def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], window: int | None) -> torch.Tensor:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = SimpleNamespace(is_causal=True, training=False)
    out, _ = packed_attention_forward(
        module,  # type: ignore[arg-type]
        q, k, v, None, scaling=0.25, sliding_window=window,
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
    )  # fmt: skip
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_equals_dense_reference_on_random_layouts(window: int) -> None:
    rng = random.Random(window)
    for _ in range(10):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        total = sum(lengths)
        generator = torch.Generator().manual_seed(total)
        q, k, v = (torch.randn(1, h, total, 8, generator=generator) for h in (4, 2, 2))
        want = F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_truth(lengths, window), scale=0.25, enable_gqa=True
        )
        assert float((call(q, k, v, lengths, window) - want).abs().max()) <= 1e-6


def test_ignoring_the_window_is_caught() -> None:
    """The oracle tells the full causal mask apart from the window (the mutation the kernel must not make)."""
    lengths = [30, 12]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=generator) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_truth(lengths, 4), scale=0.25)
    assert float((call(q, k, v, lengths, None) - want).abs().max()) > 1e-2


def test_cuda_kernel_gets_the_window_as_flash_window_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv > q - window`` is flash's left window ``window - 1`` (transformers' flash path passes the same)."""
    seen: dict[str, Any] = {}

    def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **options: Any) -> torch.Tensor:
        seen.update(options)
        return q

    params = frozenset({"window_size", "enable_gqa", "scale"})
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: (varlen_attn, params))
    q = torch.zeros(1, 2, 6, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    attention._cuda_varlen(q, q, q, cu, 6, causal=True, scaling=None, window=16)
    assert seen["window_size"] == (15, 0)
    attention._cuda_varlen(q, q, q, cu, 6, causal=True, scaling=None)
    assert seen["window_size"] == (-1, 0)
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: (varlen_attn, frozenset({"is_causal"})))
    assert attention._cuda_varlen(q, q, q, cu, 6, causal=True, scaling=None, window=16) is None  # -> exact path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel needs CUDA")
def test_cuda_varlen_window_equals_dense_reference() -> None:
    lengths = [40, 7, 33]
    total = sum(lengths)
    q, k, v = (torch.randn(1, h, total, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    got = call(q, k, v, lengths, 16).float()
    mask = dense_truth(lengths, 16).cuda()
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.25, enable_gqa=True)
    assert float((got - want).abs().max()) <= 2e-2


def test_a_sliding_window_model_packs_exactly() -> None:
    """Tiny Mistral, window 4, every layer sliding: packed per-token logits == each sample alone."""
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    lengths = [3, 17, 9]
    samples = [torch.randint(0, 64, (1, n)) for n in lengths]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        alone = [model(input_ids=s, use_cache=False).logits for s in samples]
        model.set_attn_implementation(attention.register_packed_attention())
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        packed = model(
            input_ids=torch.cat(samples, dim=1),
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
            use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=17, max_length_k=17,
        ).logits  # fmt: skip
    assert float((packed - torch.cat(alone, dim=1)).abs().max()) <= 1e-5
