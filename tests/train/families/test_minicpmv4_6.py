"""MiniCPM-V 4.6 packed: equal to each sample alone (CPU, fp32), slices, image ids and all.

A tiny random model of ``prep example --family minicpmv4_6`` (a SigLIP-like tower with the 2x2
window merger after layer 0, 16 patches a token; a Qwen3.5 decoder with one gated delta-net
layer and one gated full-attention layer) sees packs built the way `prep pack` stores them.
Pack A: text-only, one unsliced image, a sample with a sliced image (600x448: source + 1x2
slices) and an unsliced one (two ``<image_id>`` tags), text-only; pack B: a tall sliced image
(300x700: 2x1 slices), text-only. The truth is each conversation alone through the *real*
``MiniCPMV4_6Processor`` and the unmodified model (transformers' own linear attention, stock
SDPA). The delta-net weights get a long memory (as in ``test_qwen3_5``) so a state or conv leak
across samples shows at the loss.

Mutations that must fail: a slice's patches dropped (the model's own placeholder check fires),
two pieces' ``target_sizes`` swapped (same patch total: the losses move), the gated delta net
not reset per sample, one slot for the row, a stored grid / tile count / token count altered
(`PlanMismatchError`).
"""

from __future__ import annotations

import pytest
import torch

from families.minicpmv4_6.layout import MiniCPMV4_6Layout
from families.registry import find_layout
from tests.train.families.harness import (
    Setup,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_plan_mismatch,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    mixed_packs,
    two_packs,
    varlen_losses,
    with_vision,
)
from tests.train.families.test_qwen3_5 import long_memory, modeling_modules, unmodified_transformers, whole_row_rule
from tests.train.models import Sample, Truth, reference
from train import linear_attention
from train.batch import PackedBatch
from train.linear_attention import linear_attention_layers

PACKS = mixed_packs(one=(64, 64), two=((600, 448), (64, 80)), tall=(300, 700))
PIECES = {"A": [1, 3, 1], "B": [3]}  # per image in token order: source image + slices


def prepare(model) -> None:  # noqa: ANN001
    assert [type(m).__name__ for m in linear_attention_layers(model)] == ["Qwen3_5GatedDeltaNet"]
    long_memory(model)


def own_reference(model, samples: list[Sample]) -> Truth:  # noqa: ANN001
    with unmodified_transformers(modeling_modules(model)):
        return reference(model, samples)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("minicpmv4_6")
    return build_setup("minicpmv4_6", root, PACKS, vision="vision_tower", prepare=prepare, truth=own_reference)


def assert_pieces_are_the_processors(batch: PackedBatch, samples: list[Sample]) -> None:
    """The row's vision inputs are every sample's own processor output, joined in order."""
    assert_vision_joined(batch, samples, {"pixel_values": -1, "target_sizes": 0})


def test_layout_serves_minicpmv4_6_processor() -> None:
    assert find_layout("MiniCPMV4_6Processor") is MiniCPMV4_6Layout


def test_stored_plan_is_the_processors_pieces(setup: Setup) -> None:
    for name, pieces in PIECES.items():
        media = setup.pack(name).media
        assert [m.meta.num_tiles for m in media] == pieces
    grids = [m.meta.grid_thw for m in setup.pack("A").media]
    assert [tuple(g) for g in grids] == [(1, 0, 0), (1, 1, 2), (1, 0, 0)]


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = setup.encode("A", pad_to_multiple_of)
    samples = setup.samples["A"]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert_pieces_are_the_processors(batch, samples)
    packed = assert_equals_alone(setup, batch, "A")
    assert any(".linear_attn." in n and float(g.abs().max()) > 0 for n, g in packed.items())


def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup) -> None:
    batch = two_packs(setup, 16)
    assert_pieces_are_the_processors(batch, setup.samples_of("A", "B"))
    assert_equals_alone(setup, batch, "A", "B")


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)


def test_mutation_delta_state_not_reset_mixes_samples(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = setup.encode("A")
    monkeypatch.setattr(linear_attention, "segmentwise_rule", whole_row_rule)
    assert_mutation_moves(setup, "A", batch)


def test_mutation_dropping_a_slice_fails(setup: Setup) -> None:
    """The last slice of sample 2's sliced image dropped: its placeholders have no features."""
    batch = setup.encode("A")
    sizes = batch.vision["target_sizes"].long()
    patch = 14
    ends = (sizes[:, 0] * sizes[:, 1]).cumsum(0) * patch
    start, end = int(ends[2 - 1]), int(ends[2])  # piece 2: sample 2's second slice
    pixels = batch.pixel_values
    mutated = with_vision(
        batch,
        pixel_values=torch.cat([pixels[..., :start], pixels[..., end:]], dim=-1),
        target_sizes=torch.cat([batch.vision["target_sizes"][:2], batch.vision["target_sizes"][3:]]),
    )
    with pytest.raises(ValueError, match="do not match"):
        varlen_losses(setup, mutated)


def test_mutation_wrong_piece_sizes_move_the_losses(setup: Setup) -> None:
    """Every piece's (h, w) read as (w, h): the same patch counts, so no count check can fire; the
    vision tower's position ids and 2x2 windows move, and so do the losses."""
    batch = setup.encode("A")
    sizes = batch.vision["target_sizes"]
    swapped = sizes.flip(-1)
    assert not torch.equal(swapped, sizes)  # pack A holds non-square pieces (600x448's source, 64x80)
    assert_mutation_moves(setup, "A", with_vision(batch, target_sizes=swapped))


@pytest.mark.parametrize("field", ["num_tiles", "grid_thw", "num_tokens"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    meta = pack.media[1].meta  # sample 2's sliced image: grid 1 x 2
    wrong = {"num_tiles": 2, "grid_thw": (1, 2, 1), "num_tokens": meta.num_tokens - 64}
    assert_plan_mismatch(setup, pack, 1, field, wrong[field])
