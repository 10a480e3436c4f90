"""flex_attention with a document mask: the CUDA fallback where torch has no varlen kernel.

The truth is a float64 softmax with an explicit block-diagonal causal (windowed) mask over the
row (`tests.train.test_attention.brute_force`'s construction, windowed here), and each sample
alone through stock SDPA. On CPU flex runs uncompiled and forward only (torch 2.13 has no CPU
flex backward); the ``gpu`` tests run the compiled kernel, forward and backward, and a tiny
Qwen2 model packed against each sample alone.

Tolerances: fp32 attention over rows of at most ~100 keys of dimension 8 with |q|, |k|, |v| ~ N(0, 1):
each output is a convex combination of values, so its rounding error is a few ulps of |v|max
(~4): ~1e-6; 1e-5 leaves room for the exp/sum order of an unfused kernel. bf16 (8 bits of
mantissa) on the GPU: inputs rounded to 2^-8 relative, outputs compared with 2e-2 as the
existing varlen kernel test does.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import train.attention as attention
from train.attention import PACKED_ATTENTION, needs_document_mask, packed_attention_forward
from train.batch import IGNORE_INDEX, PackedBatch
from train.block_attention import IMAGE_BLOCKS_KWARG, ImageBlockRule, flex_attention_forward, flex_available

HEADS, KV_HEADS, DIM = 4, 2, 16  # compiled flex_attention on CUDA needs a head dimension of at least 16
FP32_TOLERANCE = 1e-5
#: per-token fp32 losses (~6.2) of a 2-layer model: attention differs by summation order only
#: (~1e-6 relative through two layers and the head); 1e-5 absolute is ~1e-6 relative
MODEL_TOLERANCE = 1e-5
needs_flex = pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")


class Module(torch.nn.Module):
    is_causal = True


def layout(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 7, (1,), generator=generator))
    lengths = torch.randint(1, 40, (count,), generator=generator)
    return [0, *lengths.cumsum(0).tolist()]


def qkv(total: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    shapes = (1, HEADS, total, DIM), (1, KV_HEADS, total, DIM), (1, KV_HEADS, total, DIM)
    return tuple(torch.randn(s, generator=generator, dtype=torch.float64).float().to(device) for s in shapes)


def truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], window: int | None) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(d)) v under same-sample AND causal [AND kv > q - window]; [1, H, T, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    total = q.shape[2]
    sample = torch.bucketize(torch.arange(total), torch.tensor(cu[1:]), right=True).to(q.device)
    index = torch.arange(total, device=q.device)
    allowed = (sample[:, None] == sample[None, :]) & (index[None, :] <= index[:, None])
    if window is not None:
        allowed &= index[None, :] > index[:, None] - window
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def document_rule(cu: list[int], device: str = "cpu", *, compile: bool = False) -> ImageBlockRule:
    spans = torch.zeros((0, 2), dtype=torch.int32, device=device)
    return ImageBlockRule.build(torch.tensor(cu, dtype=torch.int32), spans, cu[-1], compile=compile)


@needs_flex
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 5])
def test_flex_document_mask_equals_the_truth_on_cpu(seed: int, window: int | None) -> None:
    cu = layout(seed)
    q, k, v = qkv(cu[-1], seed)
    got = flex_attention_forward(q, k, v, document_rule(cu), window=window, scaling=None)
    assert float((got.double() - truth(q, k, v, cu, window)).abs().max()) <= FP32_TOLERANCE


@needs_flex
def test_flex_document_mask_equals_each_sample_alone_on_cpu() -> None:
    """Each sample's rows equal stock causal SDPA over that sample alone: nothing leaks across slots."""
    cu = [0, 7, 8, 40, 41, 90]
    q, k, v = qkv(cu[-1], 11)
    got = flex_attention_forward(q, k, v, document_rule(cu), window=None, scaling=None)
    for a, b in zip(cu, cu[1:]):
        alone = F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
        )
        assert float((got[:, :, a:b] - alone).abs().max()) <= FP32_TOLERANCE


def test_the_truth_tells_a_leaking_mask_apart() -> None:
    """The comparison can fail: one causal mask over the whole row differs from the document mask."""
    cu = [0, 10, 30]
    q, k, v = qkv(cu[-1], 2)
    assert float((truth(q, k, v, [0, 30], None) - truth(q, k, v, cu, None)).abs().max()) > 1e-2


def test_document_mask_only_on_cuda_without_a_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: None)
    assert needs_document_mask("cuda", PACKED_ATTENTION) is flex_available()
    assert not needs_document_mask("cpu", PACKED_ATTENTION)
    assert not needs_document_mask("cuda", "flash_attention_2")
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: (object(), frozenset()))
    assert not needs_document_mask("cuda", PACKED_ATTENTION)


@pytest.mark.parametrize("window", [None, 5])
def test_document_rule_on_cpu_keeps_the_per_sample_reference(window: int | None) -> None:
    """packvlm_varlen handed a document rule on CPU (a model call) gives the truth."""
    cu = layout(3)
    q, k, v = qkv(cu[-1], 3)
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    out, _ = packed_attention_forward(
        Module(), q, k, v, None, sliding_window=window, cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor,
        max_length_q=64, max_length_k=64, **{IMAGE_BLOCKS_KWARG: document_rule(cu)},
    )  # fmt: skip
    assert float((out.transpose(1, 2).double() - truth(q, k, v, cu, window)).abs().max()) <= FP32_TOLERANCE


def text_batch(samples: list[torch.Tensor]) -> PackedBatch:
    """A text-only packed row: positions restart per sample, each sample's first label masked."""
    input_ids = torch.cat(samples)[None]
    cu = torch.tensor([0, *torch.tensor([s.numel() for s in samples]).cumsum(0).tolist()], dtype=torch.int32)
    labels = input_ids.clone()
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=torch.cat([torch.arange(s.numel()) for s in samples])[None],
        cu_seqlens=cu,
        cu_seqlens_padded=cu.clone(),
        max_seqlen=max(s.numel() for s in samples),
        mm_token_type_ids=torch.zeros_like(input_ids),
    )


def tiny_qwen2(attn: str, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device).eval()


def packed_and_alone(
    model: torch.nn.Module, lengths: list[int], device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: the packed row's per-token losses and the sample's alone through stock SDPA."""
    from train.forward import packed_forward
    from train.loss import per_token_losses

    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 512, (n,), generator=generator) for n in lengths]
    batch = text_batch(samples).to(device)
    implementation = model.config._attn_implementation
    with torch.no_grad():
        packed = per_token_losses(packed_forward(model, batch).float(), batch.labels)[0]
        model.set_attn_implementation("sdpa")
        pairs, start = [], 0
        for ids in samples:
            ids = ids[None].to(device)
            alone = per_token_losses(model(input_ids=ids).logits.float(), ids)[0]
            # a sample's positions 0..n-2 predict its own tokens 1..n-1, as alone
            if ids.shape[1] > 1:  # a one-token sample predicts nothing
                pairs.append((packed[start : start + ids.shape[1] - 1], alone))
            start += ids.shape[1]
        model.set_attn_implementation(implementation)
    return pairs


@needs_flex
def test_packed_model_through_the_document_mask_equals_each_sample_alone_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model-level wiring of the CUDA fallback, run on CPU: `packed_inputs` builds one document
    rule per micro-batch and every layer applies it with flex (uncompiled here)."""
    import train.forward as forward
    from train.attention import register_packed_attention

    calls = []

    def flex_on_cpu(query, key, value, rule, causal, window, scaling, dropout):  # type: ignore[no-untyped-def]
        calls.append(rule)
        assert not rule.spans and causal
        out = flex_attention_forward(query, key, value, rule, window=window, scaling=scaling)
        return out.transpose(1, 2).contiguous()

    monkeypatch.setattr(forward, "needs_document_mask", lambda device, implementation: True)
    monkeypatch.setattr(attention, "_applies_rule", lambda rule, causal, query: True)  # as on CUDA
    monkeypatch.setattr(attention, "_image_block_attention", flex_on_cpu)
    model = tiny_qwen2(register_packed_attention())
    pairs = packed_and_alone(model, [33, 1, 70, 20], "cpu")
    assert len(calls) == 2 and calls[0] is calls[1]  # one rule per micro-batch, shared by both layers
    for packed, alone in pairs:
        assert float((packed - alone).abs().max()) <= MODEL_TOLERANCE


# -- CUDA: the compiled kernel, as `train hf` runs it where torch has no varlen kernel -----------------

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flex_available()), reason="needs CUDA + flex")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-under-bf16-autocast"])
def test_cuda_document_mask_forward_and_backward(
    window: int | None, autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: None)  # what torch < 2.13 has
    monkeypatch.setattr(attention, "_per_sample_sdpa", None)  # the per-sample loop must not run
    cu = [0, 17, 300, 301, 700, 1030]
    q, k, v = qkv(cu[-1], 5, "cuda")
    if not autocast:
        q, k, v = (t.bfloat16() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu_tensor = torch.tensor(cu, dtype=torch.int32, device="cuda")
    rule = document_rule(cu, "cuda", compile=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out, _ = packed_attention_forward(
            Module(), q, k, v, None, sliding_window=window, cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor,
            max_length_q=400, max_length_k=400, **{IMAGE_BLOCKS_KWARG: rule},
        )  # fmt: skip
    assert out.dtype == torch.bfloat16
    rounded = [t.detach().bfloat16().double().requires_grad_() for t in (q, k, v)]
    expected = truth(*rounded, cu, window)
    torch.testing.assert_close(out.transpose(1, 2).double(), expected, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(expected)
    out.transpose(1, 2).double().backward(grad)
    expected.backward(grad)
    for got, want in zip((q, k, v), rounded):
        scale = float(want.grad.abs().max())
        assert float((got.grad.double() - want.grad).abs().max()) <= 3e-2 * scale


@pytest.mark.gpu
@needs_cuda
def test_cuda_packed_qwen2_with_document_mask_equals_each_sample_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2 on CUDA with the flex fallback forced (fp32 weights, no autocast: flex takes fp32):
    per-token losses of the packed row equal each sample alone through stock SDPA."""
    from train.attention import register_packed_attention
    from train.forward import packed_inputs

    monkeypatch.setattr(attention, "_varlen_kernel", lambda: None)
    monkeypatch.setattr(attention, "_per_sample_sdpa", None)  # the per-sample loop must not run
    model = tiny_qwen2(register_packed_attention(), "cuda")
    probe = text_batch([torch.arange(5), torch.arange(3)]).to("cuda")
    assert IMAGE_BLOCKS_KWARG in packed_inputs(model, probe)
    for packed, alone in packed_and_alone(model, [33, 1, 500, 128], "cuda"):
        # TF32 may serve fp32 matmuls on CUDA: 1e-3 relative on losses ~6
        assert float((packed - alone).abs().max()) <= 1e-2
