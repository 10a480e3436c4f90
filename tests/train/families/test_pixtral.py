"""Pixtral (LLaVA + Pixtral tower) and Mistral 3 packed: equal to each sample alone (CPU, fp32).

Tiny random models of ``prep example --family pixtral`` / ``mistral3`` see two packs built the
way `prep pack` stores them: pack A mixes text-only, one-image and two-image samples of
different sizes; pack B a wide image the processor downscales (longest edge), a two-image
sample taller than anything in A, and text. Images of one sample, of one pack and of two
packs (``--packs-per-microbatch 2``: `concat_batches`) are zero-padded into one
``pixel_values``; the model must see only each image's ``image_sizes`` part. The truth is each
conversation alone through the *real* ``PixtralProcessor`` (its own padded batch) and the
unmodified model with stock SDPA (`tests.train.models`).

Mutations that must fail: a sample's ``image_sizes`` dropped (the model's own placeholder check
fires), two images' sizes swapped (same token total: the losses move), positions continuing
across samples on the path that infers boundaries from them, a stored grid / token count
altered (`PlanMismatchError`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from families.pixtral.layout import PixtralLayout
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
    build_setup,
    two_packs,
    varlen_losses,
    with_vision,
)
from tests.train.models import CONVERSATIONS, Conversation, Sample
from train.batch import PackedBatch

FAMILIES = ("pixtral", "mistral3")
#: pack B: 1600 x 24 exceeds both longest edges (1024, 1540): downscaled; 60 x 150 is taller than pack A
PACK_B = (
    Conversation(((1600, 24),), "Read the strip.", "A thin band of colour."),
    Conversation((), "Say hi.", "Hi."),
    Conversation(((60, 150), (130, 40)), "Which is taller?", "The first image is taller."),
)
PACKS = {"A": CONVERSATIONS, "B": PACK_B}


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build_setup(request.param, tmp_path_factory.mktemp(request.param), PACKS, vision="vision_tower")


def assert_vision_is_the_processors(batch: PackedBatch, samples: list[Sample]) -> None:
    """``image_sizes`` are the real processor's; each image's ``image_sizes`` crop of the row's
    ``pixel_values`` is the processor's own pixels, the rest of the padded tensor zeros."""
    images = [
        i
        for s in samples
        if "pixel_values" in s.inputs
        for i in zip(*(s.inputs[k] for k in ("pixel_values", "image_sizes")))
    ]
    sizes = batch.vision["image_sizes"]
    pixels = batch.pixel_values
    assert sizes.tolist() == [size.tolist() for _, size in images]
    assert tuple(pixels.shape[2:]) == tuple(int(v) for v in sizes.max(dim=0).values)  # padded to the largest
    for got, (want, (height, width)) in zip(pixels, images):
        assert torch.equal(got[:, :height, :width], want[:, :height, :width])
        assert not got[:, height:].any() and not got[:, :, width:].any()


def test_layout_serves_both_processor_classes() -> None:
    assert find_layout("PixtralProcessor") is PixtralLayout
    assert find_layout("Mistral3Processor") is PixtralLayout


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pack: str, pad_to_multiple_of: int) -> None:
    batch = setup.encode(pack, pad_to_multiple_of)
    samples = setup.samples[pack]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert set(batch.vision) == {"pixel_values", "image_sizes"}
    assert_vision_is_the_processors(batch, samples)
    assert_equals_alone(setup, batch, pack)


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    """``--packs-per-microbatch 2``: pack A's images padded to pack B's larger ones in one tensor."""
    batch = two_packs(setup, pad_to_multiple_of)
    samples = setup.samples_of("A", "B")
    assert batch.pixel_values.shape[2] > setup.encode("A").pixel_values.shape[2]  # A's images padded more
    assert_vision_is_the_processors(batch, samples)
    assert_equals_alone(setup, batch, "A", "B")


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the positions mutation: restarting positions pack exactly on that path."""
    assert_positions_path_exact(setup)


def test_mutation_positions_continuing_across_samples_mixes_them(setup: Setup) -> None:
    assert_continuing_positions_mix(setup)


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)


def test_mutation_dropping_a_samples_image_sizes_fails(setup: Setup) -> None:
    """Sample 1's single image loses its ``image_sizes`` row: the tower embeds the wrong images."""
    batch = setup.encode("A")
    sizes = batch.vision["image_sizes"]
    with pytest.raises(ValueError, match="do not match"):
        varlen_losses(setup, with_vision(batch, image_sizes=sizes[1:]))
    without = dataclasses.replace(batch, vision={"pixel_values": batch.pixel_values})
    with pytest.raises((ValueError, TypeError)):  # LLaVA: every image at full padded size; Mistral 3: required
        varlen_losses(setup, without)


def test_mutation_swapped_image_sizes_move_the_losses(setup: Setup) -> None:
    """Sample 2's two images swap sizes: the same token total, so no count check can fire."""
    batch = setup.encode("A")
    sizes = batch.vision["image_sizes"].clone()
    sizes[[1, 2]] = sizes[[2, 1]]
    assert_mutation_moves(setup, "A", with_vision(batch, image_sizes=sizes))


@pytest.mark.parametrize("field", ["grid_thw", "num_tokens", "num_tiles"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("B")
    meta = pack.media[2].meta  # sample 2's first image
    wrong = {"grid_thw": (1, meta.grid_thw[1] + 2, meta.grid_thw[2]), "num_tokens": meta.num_tokens + 1, "num_tiles": 2}
    assert_plan_mismatch(setup, pack, 2, field, wrong[field])
