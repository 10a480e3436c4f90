"""InternVL packed: equal to each sample alone (CPU, fp32), tiles and all.

A tiny random model of ``prep example --family internvl`` (InternViT on 448 px tiles, 256
``<IMG_CONTEXT>`` per tile) sees two packs built the way `prep pack` stores them. The processor
crops to tiles (``crop_to_patches`` forced on by ``InternVLProcessor``), so sizes are chosen
for few tiles: a small square image is 1 tile; a 2:1 or 1:2 image is a 2-tile canvas plus its
thumbnail, 3 tiles (a near-square non-square image would be 13). Pack A: text-only, one
1-tile image, a sample with a 3-tile and a 1-tile image, text-only (5 tiles, ~1,400 tokens);
pack B: a tall 3-tile image, text-only. The truth is each conversation alone through the
*real* ``InternVLProcessor`` and the unmodified model with stock SDPA (`tests.train.models`).

Mutations that must fail: a tile dropped (the model's own placeholder check fires), the tiles of
a sample's two images in the wrong order (tile counts 1 and 3 instead of 3 and 1: same total,
the losses move), positions continuing across samples on the path that infers boundaries from
them, one slot for the row, a stored grid / tile count / token count altered
(`PlanMismatchError`).
"""

from __future__ import annotations

import pytest
import torch

from families.internvl.layout import InternVLLayout
from families.registry import find_layout
from tests.train.families.harness import (
    Setup,
    assert_continuing_positions_mix,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_plan_mismatch,
    assert_positions_path_exact,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    mixed_packs,
    two_packs,
    varlen_losses,
    with_vision,
)
from tests.train.models import Sample
from train.batch import PackedBatch

PACKS = mixed_packs(one=(64, 64), two=((112, 56), (64, 64)), tall=(56, 112))
TILES = {"A": [1, 3, 1], "B": [3]}  # per image, in token order (the processor's num_patches)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build_setup("internvl", tmp_path_factory.mktemp("internvl"), PACKS, vision="vision_tower")


def assert_tiles_are_the_processors(batch: PackedBatch, samples: list[Sample]) -> None:
    """The row's ``pixel_values`` is every sample's own processor output, concatenated in order."""
    assert_vision_joined(batch, samples, {"pixel_values": 0})


def test_layout_serves_internvl_processor() -> None:
    assert find_layout("InternVLProcessor") is InternVLLayout


def test_stored_plan_is_the_processors_tiles(setup: Setup) -> None:
    """The packs hold what the sizes promise: 1-tile and 3-tile images (num_tiles as tokenize stores it)."""
    for name, tiles in TILES.items():
        media = setup.pack(name).media
        assert [m.meta.num_tiles for m in media] == tiles
        assert [m.meta.num_tokens for m in media] == [256 * t for t in tiles]


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = setup.encode("A", pad_to_multiple_of)
    samples = setup.samples["A"]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert batch.pixel_values.shape == (sum(TILES["A"]), 3, 448, 448)
    assert_tiles_are_the_processors(batch, samples)
    assert_equals_alone(setup, batch, "A")


def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup) -> None:
    """``--packs-per-microbatch 2``: pack B's tiles follow pack A's in one ``pixel_values``."""
    batch = two_packs(setup, 16)
    assert_tiles_are_the_processors(batch, setup.samples_of("A", "B"))
    assert_equals_alone(setup, batch, "A", "B")


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the positions mutation: restarting positions pack exactly on that path."""
    assert_positions_path_exact(setup)


def test_mutation_positions_continuing_across_samples_mixes_them(setup: Setup) -> None:
    assert_continuing_positions_mix(setup)


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)


def test_mutation_dropping_a_tile_fails(setup: Setup) -> None:
    """The thumbnail of sample 2's 3-tile image dropped: 256 placeholders without features."""
    batch = setup.encode("A")
    pixels = batch.pixel_values
    with pytest.raises(ValueError, match="do not match"):
        varlen_losses(setup, with_vision(batch, pixel_values=torch.cat([pixels[:3], pixels[4:]])))


def test_mutation_wrong_tile_counts_move_the_losses(setup: Setup) -> None:
    """Sample 2's images taken as 1 + 3 tiles instead of 3 + 1 (its single tile first): the same
    total, so no count check can fire; each placeholder gets another tile's features."""
    batch = setup.encode("A")
    pixels = batch.pixel_values  # [A1 | B1 B2 Bthumb | C1]
    reordered = torch.cat([pixels[:1], pixels[4:5], pixels[1:4]])
    assert_mutation_moves(setup, "A", with_vision(batch, pixel_values=reordered))


@pytest.mark.parametrize("field", ["num_tiles", "grid_thw", "num_tokens"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    meta = pack.media[1].meta  # sample 2's 3-tile image: canvas 2 x 1
    wrong = {"num_tiles": 2, "grid_thw": (1, 2, 1), "num_tokens": meta.num_tokens - 256}
    assert_plan_mismatch(setup, pack, 1, field, wrong[field])
