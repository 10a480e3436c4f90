"""``packvlm_varlen`` against brute-force math, and vision towers that never see text boundaries."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from families.processor import load_processor
from prep.example.media import make_image_bytes
from tests.train.models import FAMILIES, make_family, tiny_model
from train.attention import (
    PACKED_ATTENTION,
    PackedAttentionError,
    packed_attention_forward,
    packed_attention_mask,
    prepare_model_for_packing,
    select_attention,
    vision_towers,
)

HEADS, KV_HEADS, DIM = 4, 2, 8
VISION_TOLERANCE = 1e-6  # embeddings are ~2e-2 in size (tiny random init)


class Module(torch.nn.Module):
    """Stands in for an attention layer: what attention functions read of it."""

    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = HEADS // KV_HEADS


def brute_force(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with an explicit block-diagonal (causal) mask; [1, T, H, D]."""
    total = q.shape[2]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    segment = torch.zeros(total, dtype=torch.long, device=q.device)
    for start in cu[1:-1]:
        segment[start:] += 1
    allowed = segment[:, None] == segment[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2)


def random_layout(generator: torch.Generator) -> list[int]:
    lengths = torch.randint(1, 24, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator)
    return [0, *lengths.cumsum(0).tolist()]


def qkv(total: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (1, HEADS, total, DIM), (1, KV_HEADS, total, DIM), (1, KV_HEADS, total, DIM)
    return tuple(torch.randn(s, generator=generator, dtype=torch.float64).float() for s in shape)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_equals_block_diagonal_softmax(seed: int, causal: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    cu = random_layout(generator)
    q, k, v = qkv(cu[-1], generator)
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    lengths = max(b - a for a, b in zip(cu, cu[1:]))
    out, weights = packed_attention_forward(
        Module(causal), q, k, v, None, cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor,
        max_length_q=lengths, max_length_k=lengths,
    )  # fmt: skip
    assert weights is None
    torch.testing.assert_close(out, brute_force(q, k, v, cu, causal), atol=1e-5, rtol=1e-5)


def test_boundaries_from_restarting_positions_equal_explicit_ones() -> None:
    generator = torch.Generator().manual_seed(0)
    cu = [0, 5, 17, 20]
    q, k, v = qkv(cu[-1], generator)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    out, _ = packed_attention_forward(Module(), q, k, v, None, position_ids=positions)
    torch.testing.assert_close(out, brute_force(q, k, v, cu, True), atol=1e-5, rtol=1e-5)


def test_no_boundaries_is_one_sequence_and_caller_causality_wins() -> None:
    q, k, v = qkv(12, torch.Generator().manual_seed(1))
    out, _ = packed_attention_forward(Module(), q, k, v, None)
    torch.testing.assert_close(out, brute_force(q, k, v, [0, 12], True), atol=1e-5, rtol=1e-5)
    out, _ = packed_attention_forward(Module(True), q, k, v, None, is_causal=False)  # vision towers say so
    torch.testing.assert_close(out, brute_force(q, k, v, [0, 12], False), atol=1e-5, rtol=1e-5)
    last, _ = packed_attention_forward(Module(), q[:, :, -1:], k, v, None)  # cached decoding: 1 query, all keys
    torch.testing.assert_close(last, brute_force(q, k, v, [0, 12], True)[:, -1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cu", [[0, 5, 11], [0, 7, 5, 12], [3, 12], [0, 12, 13]])
def test_boundaries_that_do_not_tile_the_input_raise(cu: list[int]) -> None:
    q, k, v = qkv(12, torch.Generator().manual_seed(2))
    with pytest.raises(PackedAttentionError, match="cu_seq_lens_q"):
        packed_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=torch.tensor(cu, dtype=torch.int32))


def test_registered_and_packed_rows_build_no_mask() -> None:
    assert packed_attention_mask(attention_mask=None, batch_size=1, q_length=4096, kv_length=4096) is None
    assert ALL_ATTENTION_FUNCTIONS[PACKED_ATTENTION] is packed_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[PACKED_ATTENTION] is packed_attention_mask


def test_select_attention_on_cpu() -> None:
    assert select_attention("cpu") == PACKED_ATTENTION
    assert select_attention(torch.device("cpu")) == PACKED_ATTENTION


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's varlen kernel)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-under-bf16-autocast"])
def test_cuda_varlen_kernel_matches_brute_force(causal: bool, autocast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs (bf16 tensors, or fp32 q/k under autocast as Qwen-VL's rotary hands them
    over) and equals the math on the bf16-rounded inputs to bf16 accuracy."""
    import train.attention as attention

    calls = []
    kernel = attention._cuda_varlen
    monkeypatch.setattr(attention, "_cuda_varlen", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    cu = [0, 17, 64, 65, 200]
    q, k, v = (t.cuda() for t in qkv(cu[-1], torch.Generator().manual_seed(3)))
    cu_tensor = torch.tensor(cu, dtype=torch.int32, device="cuda")
    if not autocast:
        q, k, v = (t.bfloat16() for t in (q, k, v))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out, _ = packed_attention_forward(
            Module(causal), q, k, v, None, cu_seq_lens_q=cu_tensor, cu_seq_lens_k=cu_tensor,
            max_length_q=135, max_length_k=135,
        )  # fmt: skip
    assert calls and out.dtype == torch.bfloat16
    expected = brute_force(*(t.bfloat16().double() for t in (q, k, v)), cu, causal)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# -- vision towers -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def vision_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = make_family(request.param, tmp_path_factory.mktemp(f"vision_{request.param}"))
    image_processor = load_processor(str(family.processor_dir)).image_processor
    pil = [Image.open(io.BytesIO(make_image_bytes(w, h, seed=w))).convert("RGB") for w, h in ((112, 84), (56, 56))]
    images = [image_processor(images=[image], return_tensors="pt") for image in pil]
    return tiny_model(family).eval(), images


def image_embeds(model: torch.nn.Module, pixel_values: torch.Tensor, grid: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(pixel_values, grid, **kwargs).pooler_output)


def test_vision_tower_encodes_each_image_alone_despite_text_boundaries(vision_setup) -> None:
    model, images = vision_setup
    alone = torch.cat([image_embeds(model, i["pixel_values"], i["image_grid_thw"]) for i in images])
    pixel_values = torch.cat([i["pixel_values"] for i in images])
    grid = torch.cat([i["image_grid_thw"] for i in images])
    text_cu = torch.tensor([0, 3, 50, 51], dtype=torch.int32)  # a packed text row's boundaries
    text = {"cu_seq_lens_q": text_cu, "cu_seq_lens_k": text_cu, "max_length_q": 47, "max_length_k": 47}
    torch.testing.assert_close(image_embeds(model, pixel_values, grid, **text), alone, atol=VISION_TOLERANCE, rtol=0)
    with torch.no_grad():  # straight into the tower: the pre-hook drops them
        direct = model.model.visual(pixel_values, grid_thw=grid, **text).pooler_output
    torch.testing.assert_close(direct, alone, atol=VISION_TOLERANCE, rtol=0)


def test_vision_comparison_detects_images_attending_to_each_other(vision_setup) -> None:
    """The check above can fail: one vision segment for both images changes the embeddings."""
    model, images = vision_setup
    alone = torch.cat([image_embeds(model, i["pixel_values"], i["image_grid_thw"]) for i in images])
    pixel_values = torch.cat([i["pixel_values"] for i in images])
    grid = torch.cat([i["image_grid_thw"] for i in images])
    joint = torch.tensor([0, pixel_values.shape[0]], dtype=torch.int32)
    mixed = image_embeds(model, pixel_values, grid, image_cu_seqlens=joint)
    assert float((mixed - alone).abs().max()) > 100 * VISION_TOLERANCE


def test_every_family_has_one_guarded_vision_tower(vision_setup) -> None:
    model, _ = vision_setup
    towers = vision_towers(model)
    assert any(t is model.model.visual for t in towers)  # the Omni thinkers' audio tower is guarded too
    assert all(t is not model.model.language_model for t in towers)
    hooks = [len(t._forward_pre_hooks) for t in towers]
    prepare_model_for_packing(model)  # idempotent
    assert [len(t._forward_pre_hooks) for t in towers] == hooks == [1] * len(towers)


def test_padded_unpacked_batch_behaves_like_sdpa(vision_setup) -> None:
    """A padding mask (no packing) takes transformers' SDPA mask and kernel: same logits."""
    model, _ = vision_setup
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.randint(0, min(1000, vocab), (2, 9), generator=torch.Generator().manual_seed(4))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ours = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        model.set_attn_implementation("sdpa")
        try:
            stock = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        finally:
            model.set_attn_implementation(PACKED_ATTENTION)
    keep = attention_mask.bool()
    torch.testing.assert_close(ours[keep], stock[keep], atol=1e-6, rtol=1e-6)
