"""Kimi K2.5 VL packed: equal to each sample alone (CPU, fp32; the processor needs torchvision).

A tiny random model of ``prep example --family kimi_k25`` (2-layer MoonViT with its 2x2 merger,
2-layer DeepSeek-V3 decoder: MLA attention, layer 1 a MoE of 4 routed experts, top 2, one shared
expert) sees two packs built the way `prep pack` stores them: pack A mixes text-only, one-image
and two-image samples; pack B images whose sides are no multiple of 28 px (zero-padded by the
processor before normalising), a 1 x 1 image and text. The truth is each conversation alone
through the *real* ``Kimi_K25Processor`` and the unmodified ``Kimi_K25ForConditionalGeneration``
with stock SDPA (`tests.train.models`).

Why nothing crosses samples: MoonViT attends per image (``cu_seqlens`` from
``image_grid_thw``), the decoder's rotary is 1-D (positions restart per sample), MoE routing is
per token and transformers' DeepSeek-V3 adds no auxiliary or sequence-level balance loss; the
test checks the summed loss equals the samples' token losses, so a row-level term would show.

Mutations that must fail: positions continuing across samples, the row as one attention slot,
an image's grid transposed (same token count: the pixels are read as another shape).
"""

from __future__ import annotations

import pytest

from tests.train.families.harness import (
    Setup,
    assert_continuing_positions_mix,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_positions_path_exact,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    two_packs,
    with_vision,
)
from tests.train.models import CONVERSATIONS, Conversation

pytestmark = pytest.mark.torchvision

PACK_B = (
    Conversation(((130, 41),), "Read the strip.", "A thin band of colour."),
    Conversation((), "Say hi.", "Hi."),
    Conversation(((1, 1), (45, 150)), "Which is taller?", "The second image is taller."),
)
PACKS = {"A": CONVERSATIONS, "B": PACK_B}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    pytest.importorskip("torchvision")
    return build_setup("kimi_k25", tmp_path_factory.mktemp("kimi_k25"), PACKS, vision="vision_tower")


def test_layout_is_registered() -> None:
    from families.kimi_k25.layout import KimiK25Layout
    from families.registry import find_layout

    assert find_layout("Kimi_K25Processor") is KimiK25Layout


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pack: str, pad_to_multiple_of: int) -> None:
    batch = setup.encode(pack, pad_to_multiple_of)
    samples = setup.samples[pack]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert_vision_joined(batch, samples, {"pixel_values": 0, "image_grid_thw": 0})  # the real processor's
    assert_equals_alone(setup, batch, pack)


def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup) -> None:
    assert_equals_alone(setup, two_packs(setup), "A", "B")


def test_positions_path_is_exact_too(setup: Setup) -> None:
    assert_positions_path_exact(setup)


def test_mutation_positions_continuing_across_samples_mixes_them(setup: Setup) -> None:
    assert_continuing_positions_mix(setup)


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)


def test_mutation_a_transposed_grid_moves_the_losses(setup: Setup) -> None:
    """Sample 2's first image (grid 1 x 6 x 8) read as 1 x 8 x 6: the same token count, other pixels."""
    batch = setup.encode("A")
    grids = batch.vision["image_grid_thw"].clone()
    grids[1, 1], grids[1, 2] = int(grids[1, 2]), int(grids[1, 1])
    assert grids[1].tolist() != batch.vision["image_grid_thw"][1].tolist()
    assert_mutation_moves(setup, "A", with_vision(batch, image_grid_thw=grids))
