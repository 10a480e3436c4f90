"""PaddleOCR-VL packed: equal to each sample alone (CPU, fp32).

The tiny random model of ``prep example --family paddleocr_vl`` (ERNIE-4.5 decoder with 3-D
mRoPE, NaViT-style vision tower, 2x2 projector) sees two packs built the way `prep pack` stores
them from the real ``PaddleOCRVLProcessor`` outputs: pack A mixes text-only, one-image and
two-image samples (every image scaled *up* to ``min_pixels`` 147384); pack B a wide strip and a
thin column (sides under 28 scaled up first), a two-image sample and text. The truth is each
conversation alone through the real processor and the unmodified model (stock SDPA, the model
computing its own ``get_rope_index``; `tests.train.models`).

What mixes tokens across the row, and where the pack keeps it per sample: the vision encoder
attends within each image (``cu_seqlens`` from ``image_grid_thw``), the projector merges per
image, the decoder is plain causal attention (document mask from the slot boundaries) with
positions ``[4, 1, T]`` from ``get_rope_index`` of each sample alone.

Mutations that must fail: the rope index over the whole row (positions path), the whole row as
one slot (varlen path), one image's grid transposed (same patch and token counts: only the
vision positions and the 2x2 merge move), a stored grid / token count altered
(`PlanMismatchError`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from families.paddleocr_vl.layout import PaddleOCRVLLayout
from families.registry import find_layout
from tests.train.families.harness import (
    LARGE,
    Setup,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_plan_mismatch,
    assert_positions_path_exact,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    loss_diff,
    positions_losses,
    two_packs,
    with_vision,
)
from tests.train.models import CONVERSATIONS, Conversation
from train.batch import PackedBatch

#: pack B: 300 x 40 -> 1064 x 168 (grid 12 x 76); 20 x 600 -> 28 x 840 first, then up to min_pixels
PACK_B = (
    Conversation(((300, 40),), "OCR:", "Total 12.50 EUR"),
    Conversation((), "Say hi.", "Hi."),
    Conversation(((20, 600), (90, 70)), "Table Recognition:", "<fcel>a<fcel>b<nl>"),
)
PACKS = {"A": CONVERSATIONS, "B": PACK_B}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build_setup("paddleocr_vl", tmp_path_factory.mktemp("paddleocr_vl"), PACKS, vision="visual")


def whole_row_positions(setup: Setup, batch: PackedBatch) -> PackedBatch:
    """The bug: the model's rope index over the whole row as one sample, text row 0..T-1."""
    rope = setup.encoder.rope.sample_positions(batch.input_ids[0], batch.vision_inputs())
    text = torch.arange(batch.num_tokens).view(1, -1)
    return dataclasses.replace(batch, position_ids=torch.cat([text, rope])[:, None, :])


def test_layout_serves_the_processor_class() -> None:
    assert find_layout("PaddleOCRVLProcessor") is PaddleOCRVLLayout


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pack: str, pad_to_multiple_of: int) -> None:
    batch = setup.encode(pack, pad_to_multiple_of)
    samples = setup.samples[pack]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch, rows=4)
    assert_vision_joined(batch, samples, {"pixel_values": 0, "image_grid_thw": 0})  # the real processor's
    assert_equals_alone(setup, batch, pack)


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    """``--packs-per-microbatch 2``: both packs' patches and grids in one row."""
    assert_equals_alone(setup, two_packs(setup, pad_to_multiple_of), "A", "B")


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the positions mutation: correct 4-row positions pack exactly on that path."""
    assert_positions_path_exact(setup, "B")


def test_mutation_whole_row_positions_mixes_samples(setup: Setup) -> None:
    batch = whole_row_positions(setup, setup.encode("B"))
    assert loss_diff(setup.truth["B"], batch, positions_losses(setup, batch)) > LARGE


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)


def test_mutation_transposed_grid_moves_the_losses(setup: Setup) -> None:
    """Pack B's first image (grid 12 x 76) read as 76 x 12: same patches, same tokens, no count check fires."""
    batch = setup.encode("B")
    grids = batch.vision["image_grid_thw"].clone()
    assert grids[0, 1] != grids[0, 2]
    grids[0, 1:] = grids[0, [2, 1]]
    assert_mutation_moves(setup, "B", with_vision(batch, image_grid_thw=grids))


@pytest.mark.parametrize("field", ["grid_thw", "num_tokens", "num_tiles"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("B")
    meta = pack.media[1].meta  # sample 2's first image
    wrong = {"grid_thw": (1, meta.grid_thw[1] + 2, meta.grid_thw[2]), "num_tokens": meta.num_tokens + 1, "num_tiles": 2}
    assert_plan_mismatch(setup, pack, 1, field, wrong[field])
