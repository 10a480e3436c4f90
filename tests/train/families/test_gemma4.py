"""Gemma 4 packed: equal to each sample alone through the unmodified model (CPU, fp32).

The tiny random model of ``prep example --family gemma4`` (one sliding layer, window 16, one
full layer with its own head size and K = V, ``use_bidirectional_attention: "vision"`` as
gemma-4-31B-it) sees packs built the way `prep pack` stores them: pack A mixes text-only,
one-image and two-image samples (`tests.train.models.CONVERSATIONS`); pack B a long text-only
sample and an image followed by a long reply. Every image block is far longer than the window,
so the window, the bidirectional blocks (sliding layers only) and their interplay all matter.
The truth is each conversation alone through the *real* ``Gemma4Processor`` and the unmodified
``Gemma4ForConditionalGeneration`` with stock SDPA and the processor's ``mm_token_type_ids``
(transformers builds its own masks from them, `tests.train.models`).

Mutations that must fail: the image blocks attended causally (the batch without
``image_blocks``), the blocks applied on the full layer too (Gemma 3's rule), the sliding window
ignored, one slot for the whole row, a stored token count that disagrees with the row.

Precision: per-token losses are compared in fp32 (within 1e-5). Gradients are compared with the
model in float64 (truth and packed, rtol = atol = 1e-5): in fp32 the summed-loss gradients of
this model (embeddings scaled by sqrt(hidden), attention scale 1, K = V) differ between any two
summation orders by up to ~3e-5 relative (measured: the packed row with slots padded to 16 vs
the samples alone; the vision features are bit-identical, the text attention is not), above the
tolerance though no token sees another sample. In float64 they agree to ~1.5e-6 -- not to 1e-12,
because Gemma 4 keeps float32 islands in a float64 model (the rotary tables, the vision
pooler, eager softmax): even transformers' own sdpa and eager logits of one sample differ by
3e-7 there.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from families.gemma4.layout import Gemma4Layout
from families.registry import find_layout
from tests.train.families.harness import (
    LONG_PACK,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    assert_mutation_moves,
    assert_one_slot_mixes,
    assert_plan_mismatch,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    loss_diff,
    model_blocks,
    sliding_window_ignored,
    stock_processor,
    two_packs,
    varlen_losses,
)
from tests.train.models import CONVERSATIONS, Family
from train.block_attention import ImageBlockRule, image_block_layers
from train.pixels import PackedPixels

LARGE = 1e-3  # a mutation must move some per-token loss by 100x the tolerance at least
PACKS = {"A": CONVERSATIONS, "B": LONG_PACK}


def thinking_processor(family: Family) -> object:
    """The real processor rendering with ``enable_thinking``: its generation prompt is then ``<|turn>model\\n``,
    a prefix of the conversation (without it the prompt ends in an empty thought channel that the
    rendered history does not hold, and the truth's prompt/reply split needs a prefix)."""
    processor = stock_processor(family)
    render = processor.apply_chat_template  # type: ignore[attr-defined]
    processor.apply_chat_template = functools.partial(render, enable_thinking=True)  # type: ignore[attr-defined]
    return processor


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("gemma4")
    return build_setup("gemma4", root, PACKS, vision="vision_tower", processor=thinking_processor)


@pytest.fixture(scope="module")
def setup64(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """The same model and packs in float64 (truths too): where the gradients are compared (module docstring)."""
    root = tmp_path_factory.mktemp("gemma4_64")
    return build_setup(
        "gemma4", root, PACKS, vision="vision_tower", processor=thinking_processor, prepare=lambda m: m.double()
    )


def test_layout_is_registered_and_blocks_hold_on_sliding_layers(setup: Setup) -> None:
    assert find_layout("Gemma4Processor") is Gemma4Layout
    layout = setup.encoder.media.layout
    assert isinstance(layout, Gemma4Layout) and layout.image_attention == "bidirectional"
    assert dict(layout.mm_token_ids) == {1: setup.model.config.image_token_id}
    config = setup.model.config
    assert image_block_layers(config) == "sliding"
    config.text_config.use_bidirectional_attention = None  # the E2B / E4B setting: causal everywhere
    try:
        assert image_block_layers(config) == "none"
    finally:
        config.text_config.use_bidirectional_attention = "vision"


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pack: str, pad_to_multiple_of: int) -> None:
    batch = setup.encode(pack, pad_to_multiple_of)
    samples = setup.samples[pack]
    assert_slots(batch, samples, pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert batch.image_blocks.tolist() == model_blocks(samples, batch)
    assert all(b - a > 16 for a, b in batch.image_blocks.tolist())  # every block longer than the window
    assert isinstance(batch.vision["pixel_values"], PackedPixels)  # 8-bit patch rows from the worker
    assert_vision_joined(batch, samples, {"pixel_values": 0, "image_position_ids": 0})  # the processor's
    assert loss_diff(setup.truth[pack], batch, varlen_losses(setup, batch)) <= TOLERANCE  # fp32 losses


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_float64_losses_and_grads_equal_samples_alone(setup64: Setup, pack: str, pad_to_multiple_of: int) -> None:
    assert next(setup64.model.parameters()).dtype == torch.float64
    assert_equals_alone(setup64, setup64.encode(pack, pad_to_multiple_of), pack)


def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup, setup64: Setup) -> None:
    for s in (setup, setup64):
        batch = two_packs(s, 16)
        assert batch.image_blocks.tolist() == model_blocks(s.samples_of("A", "B"), batch)
        if s is setup:
            assert loss_diff(s.truth_of("A", "B"), batch, varlen_losses(s, batch)) <= TOLERANCE
        else:
            assert_equals_alone(s, batch, "A", "B")


def test_mutation_image_blocks_causal_moves_the_losses(setup: Setup) -> None:
    batch = setup.encode("A")
    assert_mutation_moves(setup, "A", dataclasses.replace(batch, image_blocks=batch.image_blocks[:0]), LARGE)


def test_mutation_blocks_on_the_full_layer_too_move_the_losses(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's rule (blocks on every layer) is not Gemma 4's."""
    monkeypatch.setattr(ImageBlockRule, "for_layer", lambda self, window: self)
    assert_mutation_moves(setup, "A", setup.encode("A"), LARGE)


def test_mutation_sliding_window_ignored_moves_the_losses(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    sliding_window_ignored(monkeypatch)
    assert_mutation_moves(setup, "B", setup.encode("B"), LARGE)


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup, large=LARGE)


@pytest.mark.parametrize("field", ["num_tokens", "grid_thw"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    meta = pack.media[1].meta  # sample 2's first image
    wrong = {"num_tokens": meta.num_tokens + 1, "grid_thw": (1, meta.grid_thw[2], meta.grid_thw[1] + 1)}
    assert_plan_mismatch(setup, pack, 1, field, wrong[field])
