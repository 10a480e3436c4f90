"""Packing equivalence: a packed forward/backward equals each sample run alone (CPU, fp32).

Tiny random models of every patch-grid (mRoPE) family (`tests.train.models.FAMILIES`:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V, GLM-4.6V and the Qwen2.5-Omni / Qwen3-Omni thinkers,
built by `prep example`) see four conversations (text-only, one image, two images, text-only)
as one pack built the way `prep pack` stores it and encoded by `PackEncoder`; the truth is
each conversation alone through the real processor and the model's stock attention
(`tests.train.models`). The Omni thinkers carry an audio tower the data never reaches: its
parameters get no gradient either way.

Two packing paths exist and both are checked:

- *varlen* (what `train hf` runs): `packed_forward` passes the slot boundaries explicitly to
  ``packvlm_varlen``. Boundaries that do not come from ``position_ids`` make that path immune
  to whole-row positions and to ``use_cache`` (asserted below); it fails when the boundaries
  are wrong (one slot for the row).
- *positions* (what transformers does when no ``cu_seq_lens`` are passed: SDPA, and the same
  rule in flash-attention): the boundaries are inferred from ``position_ids[0]`` restarting
  at 0. Whole-row positions and ``use_cache=True`` each make it mix samples (asserted large).

Unmasking a sample's first label fails on any path: the pack then trains the previous
sample's last token to predict it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prep.tokenize.processor import load_processor
from tests.train.models import (
    CONVERSATIONS,
    FAMILIES,
    Truth,
    grads_of,
    make_family,
    max_grad_error,
    pack_samples,
    process,
    reference,
    scatter_truth,
    tiny_model,
)
from train.attention import VARLEN_KWARGS
from train.batch import IGNORE_INDEX, PackedBatch
from train.encoder import PackEncoder
from train.forward import packed_forward, packed_inputs
from train.loss import per_token_losses, token_loss_sum

TOLERANCE = 1e-5  # the bound for losses (absolute) and gradients (rtol = atol) in fp32
LARGE = 1e-2  # a mutation must move some per-token loss by 1000x the tolerance at least


@dataclasses.dataclass
class Setup:
    model: torch.nn.Module
    samples: list
    truth: Truth
    encoder: PackEncoder
    processor_dir: Path


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    family = make_family(request.param, tmp_path_factory.mktemp(request.param))
    processor = load_processor(str(family.processor_dir)).processor
    samples = [process(processor, c) for c in CONVERSATIONS]
    model = tiny_model(family)
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    return Setup(model, samples, reference(model, samples), encoder, family.processor_dir)


def encode(setup: Setup, pad_to_multiple_of: int = 1) -> PackedBatch:
    return setup.encoder.encode(pack_samples(setup.samples, setup.processor_dir, pad_to_multiple_of=pad_to_multiple_of))


def loss_diff(setup: Setup, batch: PackedBatch, losses: torch.Tensor) -> float:
    """Largest |packed - alone| over every predicted position of the row."""
    expected = scatter_truth(setup.truth, batch.cu_seqlens_padded, batch.num_tokens)
    return float((losses.detach().reshape(-1) - expected).abs().max())


@torch.no_grad()
def varlen_losses(setup: Setup, batch: PackedBatch, **overrides: object) -> torch.Tensor:
    """Per-token losses of the varlen path; ``overrides`` replace keywords of the packed call."""
    return per_token_losses(setup.model(**(packed_inputs(setup.model, batch) | overrides)).logits, batch.labels)


@torch.no_grad()
def positions_losses(setup: Setup, batch: PackedBatch, *, use_cache: bool = False) -> torch.Tensor:
    """Per-token losses when transformers infers the boundaries from position_ids (stock SDPA)."""
    inputs = {k: v for k, v in packed_inputs(setup.model, batch).items() if k not in VARLEN_KWARGS}
    setup.model.set_attn_implementation("sdpa")
    try:
        return per_token_losses(setup.model(**inputs | {"use_cache": use_cache}).logits, batch.labels)
    finally:
        setup.model.set_attn_implementation("packvlm_varlen")


def whole_row_positions(setup: Setup, batch: PackedBatch) -> PackedBatch:
    """The bug: the family's rope index over the whole row as one sample (its arguments bound by
    the installed signature, as for one sample), text row 0..T-1: samples continue each other."""
    rope = setup.encoder.rope.sample_positions(batch.input_ids[0], batch.vision)
    text = torch.arange(batch.num_tokens).view(1, -1)
    return dataclasses.replace(batch, position_ids=torch.cat([text, rope])[:, None, :])


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = encode(setup, pad_to_multiple_of)
    lengths = [s.input_ids.shape[1] for s in setup.samples]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch.position_ids.shape == (4, 1, batch.num_tokens)
    assert (batch.num_tokens > batch.num_real_tokens) == (pad_to_multiple_of > 1)
    assert batch.image_grid_thw.shape[0] == sum(len(c.image_sizes) for c in CONVERSATIONS)

    setup.model.zero_grad(set_to_none=True)
    logits = packed_forward(setup.model, batch)
    assert loss_diff(setup, batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    summed, count = token_loss_sum(logits, batch.labels)
    assert count == sum(int((s.labels[0, 1:] != IGNORE_INDEX).sum()) for s in setup.samples)
    assert abs(float(summed.detach()) - float(sum(t.sum() for t in setup.truth.losses))) <= TOLERANCE * count
    summed.backward()
    packed = grads_of(setup.model)
    setup.model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, setup.truth.grads) <= TOLERANCE  # rtol = atol = 1e-5 (models.max_grad_error)
    untouched = {n for n, _ in setup.model.named_parameters()} - packed.keys()
    assert all(".audio_tower." in n for n in untouched), sorted(untouched)[:3]  # all but the Omni audio tower
    assert any("visual" in name and float(g.abs().max()) > 0 for name, g in packed.items())


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the mutations below: correct 4-row positions pack exactly on that path."""
    batch = encode(setup)
    assert loss_diff(setup, batch, positions_losses(setup, batch)) <= TOLERANCE


def test_mutation_whole_row_positions_mixes_samples(setup: Setup) -> None:
    batch = whole_row_positions(setup, encode(setup))
    assert loss_diff(setup, batch, positions_losses(setup, batch)) > LARGE


def test_mutation_use_cache_mixes_samples(setup: Setup) -> None:
    batch = encode(setup)
    assert loss_diff(setup, batch, positions_losses(setup, batch, use_cache=True)) > LARGE


def test_mutation_unmasked_first_label_adds_cross_sample_loss(setup: Setup) -> None:
    batch = encode(setup)
    labels = batch.labels.clone()
    starts = batch.cu_seqlens_padded[1:-1].long()
    labels[0, starts] = batch.input_ids[0, starts]
    mutated = dataclasses.replace(batch, labels=labels)
    assert loss_diff(setup, mutated, varlen_losses(setup, mutated)) > LARGE
    assert loss_diff(setup, mutated, positions_losses(setup, mutated)) > LARGE


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    batch = encode(setup)
    whole = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    mutated = dataclasses.replace(batch, cu_seqlens_padded=whole, max_seqlen=batch.num_tokens)
    assert loss_diff(setup, batch, varlen_losses(setup, mutated)) > LARGE


def test_explicit_boundaries_make_positions_and_cache_harmless(setup: Setup) -> None:
    """Why `packed_forward` passes cu_seqlens: rope is relative, so a per-sample constant shift
    of all positions changes nothing once attention cannot cross slots; a cache changes nothing
    either. The call still sets use_cache=False and attention_mask=None."""
    batch = encode(setup)
    inputs = packed_inputs(setup.model, batch)
    assert inputs["use_cache"] is False and inputs["attention_mask"] is None
    assert loss_diff(setup, batch, varlen_losses(setup, whole_row_positions(setup, batch))) <= TOLERANCE
    assert loss_diff(setup, batch, varlen_losses(setup, batch, use_cache=True)) <= TOLERANCE
