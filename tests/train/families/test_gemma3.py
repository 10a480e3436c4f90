"""Gemma 3 packed: equal to each sample alone through the unmodified model (CPU, fp32).

The tiny random model of ``prep example --family gemma3`` (one sliding layer, window 16, one
full layer) sees packs built the way `prep pack` stores them: pack A mixes text-only, one-image
and two-image samples; pack B a long text-only sample and an image followed by a long reply.
Every sample is far longer than the window (each image alone is 256 soft tokens), so the
window, the bidirectional blocks and their interplay all matter. The truth is each
conversation alone through the *real* ``Gemma3Processor`` and the unmodified
``Gemma3ForConditionalGeneration`` with stock SDPA and the processor's ``token_type_ids``
(transformers builds its own bidirectional-block masks from them; `tests.train.models`).

The example model initialises ``mm_input_projection_weight`` to zeros (Gemma 3's
``_init_weights``): image embeddings are then exactly 0 and the first RMSNorm's derivative
there is 1/sqrt(eps) = 1000, so that weight's summed gradient reaches ~5e8 and is all
rounding. The fixture draws it from N(0, 0.02) like the other weights.

Mutations that must fail: the image blocks attended causally (the batch without
``image_blocks``), one image block attending to the next image of its sample, the sliding
window ignored, a stored tile / token count that disagrees with the row (`PlanMismatchError`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from families.gemma3.layout import Gemma3Layout
from families.registry import find_layout
from tests.train.families.harness import (
    LONG_PACK,
    Setup,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_plan_mismatch,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    model_blocks,
    sliding_window_ignored,
    two_packs,
)
from tests.train.models import CONVERSATIONS, make_family
from train import block_attention
from train.attention import PACKED_ATTENTION
from train.media import PlanMismatchError
from train.models import load_model

LARGE = 1e-3  # a mutation must move some per-token loss by 100x the tolerance at least
PACKS = {"A": CONVERSATIONS, "B": LONG_PACK}


def nonzero_projector(model: PreTrainedModel) -> None:
    """Module docstring: a zero projector makes its gradient ill-conditioned."""
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("gemma3")
    return build_setup("gemma3", root, PACKS, vision="vision_tower", prepare=nonzero_projector)


def test_flash_attention_request_loads_packvlm_varlen(tmp_path: Path) -> None:
    """Gemma 3 refuses flash attention (it drops the image blocks): `train hf` on a flash-attn GPU gets ours."""
    family = make_family("gemma3", tmp_path)
    model = load_model(family.model_dir, seed=0, attn_implementation="flash_attention_2")
    assert model.config._attn_implementation == PACKED_ATTENTION


def test_layout_is_registered_and_uses_the_soft_token(setup: Setup) -> None:
    assert find_layout("Gemma3Processor") is Gemma3Layout
    layout = setup.encoder.media.layout
    assert isinstance(layout, Gemma3Layout) and layout.image_attention == "bidirectional"
    assert dict(layout.mm_token_ids) == {1: setup.model.config.image_token_id}  # not <start_of_image>


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pack: str, pad_to_multiple_of: int) -> None:
    batch = setup.encode(pack, pad_to_multiple_of)
    samples = setup.samples[pack]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert min(s.input_ids.shape[1] for s in samples) > 16  # every sample is longer than the window
    assert batch.image_blocks.tolist() == model_blocks(samples, batch, "token_type_ids")
    assert_vision_joined(batch, samples, {"pixel_values": 0})  # the real processor's, token order
    assert_equals_alone(setup, batch, pack)


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    """``--packs-per-microbatch 2``: pack B's image blocks shift with its row offset."""
    batch = two_packs(setup, pad_to_multiple_of)
    assert batch.image_blocks.tolist() == model_blocks(setup.samples_of("A", "B"), batch, "token_type_ids")
    assert batch.image_blocks[-1, 0] >= setup.encode("A", pad_to_multiple_of).num_tokens  # B's block, moved past A
    assert_equals_alone(setup, batch, "A", "B")


def test_mutation_image_blocks_causal_moves_the_losses(setup: Setup) -> None:
    """Without its image blocks the row is plain causal (sliding) attention: image tokens lose their future."""
    batch = setup.encode("A")
    assert_mutation_moves(setup, "A", dataclasses.replace(batch, image_blocks=batch.image_blocks[:0]), LARGE)


def test_mutation_an_image_block_attending_to_the_next_image_moves_the_losses(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All image tokens of a sample as one block: sample 2's first image sees its second."""
    original = block_attention.allowed
    monkeypatch.setattr(
        block_attention,
        "allowed",
        lambda q, kv, slots, blocks, window: original(q, kv, slots, blocks.clamp(max=0), window),
    )
    assert_mutation_moves(setup, "A", setup.encode("A"), LARGE)


def test_mutation_sliding_window_ignored_moves_the_losses(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    sliding_window_ignored(monkeypatch)
    assert_mutation_moves(setup, "B", setup.encode("B"), LARGE)


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup, large=LARGE)


@pytest.mark.parametrize("field", ["num_tokens", "num_tiles", "grid_thw"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    meta = pack.media[1].meta  # sample 2's first image
    wrong = {"num_tokens": meta.num_tokens * 2, "num_tiles": 2, "grid_thw": (1, 1, 3)}
    assert_plan_mismatch(setup, pack, 1, field, wrong[field])


def test_image_token_runs_that_differ_from_the_plan_are_refused(setup: Setup) -> None:
    """A soft token typed into the text (a run the plan does not have) is a plan mismatch, never a block."""
    pack = setup.pack("A")
    ids = pack.input_ids.copy()
    soft = setup.model.config.image_token_id
    ids[pack.cu_seqlens[0] + 3] = soft  # inside sample 0 (text only)
    with pytest.raises(PlanMismatchError, match=r"sample sample-0: image-token runs of lengths \[1\]"):
        setup.encoder.encode(dataclasses.replace(pack, input_ids=ids))
