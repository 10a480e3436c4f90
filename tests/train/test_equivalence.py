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

import pytest
import torch

from tests.train.models import CONVERSATIONS, FAMILIES
from tests.train.packed_truth import (
    LARGE,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    build_setup,
    loss_diff,
    one_slot,
    positions_losses,
    unmasked_first_labels,
    varlen_losses,
)
from train.batch import PackedBatch
from train.forward import packed_inputs


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp(request.param)
    return build_setup(request.param, root, {"A": CONVERSATIONS}, vision="visual", untouched=(".audio_tower.",))


def whole_row_positions(setup: Setup, batch: PackedBatch) -> PackedBatch:
    """The bug: the family's rope index over the whole row as one sample (its arguments bound by
    the installed signature, as for one sample), text row 0..T-1: samples continue each other."""
    rope = setup.encoder.rope.sample_positions(batch.input_ids[0], batch.vision_inputs())
    text = torch.arange(batch.num_tokens).view(1, -1)
    return dataclasses.replace(batch, position_ids=torch.cat([text, rope])[:, None, :])


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = setup.encode("A", pad_to_multiple_of)
    lengths = [s.input_ids.shape[1] for s in setup.samples["A"]]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch.position_ids.shape == (4, 1, batch.num_tokens)
    assert (batch.num_tokens > batch.num_real_tokens) == (pad_to_multiple_of > 1)
    assert batch.image_grid_thw.shape[0] == sum(len(c.image_sizes) for c in CONVERSATIONS)
    assert_equals_alone(setup, batch, "A")  # every parameter but the Omni audio tower's, "visual" moved


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the mutations below: correct 4-row positions pack exactly on that path."""
    batch = setup.encode("A")
    assert loss_diff(setup.truth["A"], batch, positions_losses(setup, batch)) <= TOLERANCE


def test_mutation_whole_row_positions_mixes_samples(setup: Setup) -> None:
    batch = whole_row_positions(setup, setup.encode("A"))
    assert loss_diff(setup.truth["A"], batch, positions_losses(setup, batch)) > LARGE


def test_mutation_use_cache_mixes_samples(setup: Setup) -> None:
    batch = setup.encode("A")
    assert loss_diff(setup.truth["A"], batch, positions_losses(setup, batch, use_cache=True)) > LARGE


def test_mutation_unmasked_first_label_adds_cross_sample_loss(setup: Setup) -> None:
    mutated = unmasked_first_labels(setup.encode("A"))
    assert loss_diff(setup.truth["A"], mutated, varlen_losses(setup, mutated)) > LARGE
    assert loss_diff(setup.truth["A"], mutated, positions_losses(setup, mutated)) > LARGE


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    batch = setup.encode("A")
    assert loss_diff(setup.truth["A"], batch, varlen_losses(setup, one_slot(batch))) > LARGE


def test_explicit_boundaries_make_positions_and_cache_harmless(setup: Setup) -> None:
    """Why `packed_forward` passes cu_seqlens: rope is relative, so a per-sample constant shift
    of all positions changes nothing once attention cannot cross slots; a cache changes nothing
    either. The call still sets use_cache=False and attention_mask=None."""
    batch = setup.encode("A")
    inputs = packed_inputs(setup.model, batch)
    assert inputs["use_cache"] is False and inputs["attention_mask"] is None
    assert loss_diff(setup.truth["A"], batch, varlen_losses(setup, whole_row_positions(setup, batch))) <= TOLERANCE
    assert loss_diff(setup.truth["A"], batch, varlen_losses(setup, batch, use_cache=True)) <= TOLERANCE
