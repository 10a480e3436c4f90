"""What every family's packed-vs-alone test checks, written once (on `tests.train.packed_truth`).

A family test builds its `Setup` (`build_setup`: the tiny model of ``prep example --family F``,
named packs of real-processor samples mixing text-only, one-image and multi-image
conversations, each sample's truth alone) and then asks, per pack and slot padding:

- the row's layout: slots are the samples (`assert_slots`), positions restart per sample
  (`assert_restarting_positions`), the vision keywords are the samples' own processor outputs
  joined in token order (`assert_vision_joined`);
- the claim: `assert_equals_alone` (per-token losses, summed loss, gradients within
  `TOLERANCE`), for one pack or for two joined by ``--packs-per-microbatch 2`` (`two_packs`);
- the mutations that must fail: positions continuing across samples on the path that infers
  boundaries from them (`assert_positions_path_exact` is that path's oracle), the row as one
  attention slot, any other mutated batch (`assert_mutation_moves`: some per-token loss moves by
  more than ``large``, `LARGE` unless the family states its own).

What is the family's own (its packs, its processor hook, its weights, its extra mutations and
plan checks) stays in its test module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest
import torch

from tests.train.models import Conversation, Sample
from tests.train.packed_truth import (
    LARGE,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    assert_plan_mismatch,
    build_setup,
    continuing_positions,
    loss_diff,
    one_slot,
    positions_losses,
    stock_processor,
    unmasked_first_labels,
    varlen_losses,
)
from train import block_attention
from train.batch import PackedBatch, concat_batches
from train.image_blocks import token_runs

__all__ = [
    "LARGE",
    "LONG_PACK",
    "TOLERANCE",
    "Setup",
    "assert_continuing_positions_mix",
    "assert_equals_alone",
    "assert_mutation_moves",
    "assert_one_slot_mixes",
    "assert_plan_mismatch",
    "assert_positions_path_exact",
    "assert_restarting_positions",
    "assert_slots",
    "assert_vision_joined",
    "build_setup",
    "loss_diff",
    "mixed_packs",
    "model_blocks",
    "positions_losses",
    "sliding_window_ignored",
    "split_pack",
    "stock_processor",
    "two_packs",
    "unmasked_first_labels",
    "varlen_losses",
    "with_vision",
]

#: a long text-only sample and an image followed by a long reply: both far longer than a window of 16
LONG_PACK = (
    Conversation((), "Tell me a long story about a cat, a dog and a tree next to the house.", "Once upon a time " * 6),
    Conversation(((90, 60),), "Describe the image in detail.", "It is a picture of colours. " * 4),
)


def mixed_packs(
    one: tuple[int, int], two: tuple[tuple[int, int], tuple[int, int]], tall: tuple[int, int]
) -> dict[str, tuple[Conversation, ...]]:
    """Pack A: text-only, image ``one``, the two images ``two``, text-only; pack B: image ``tall``, text-only
    (sizes are (width, height), chosen per family for the tiles / slices they make)."""
    return {
        "A": (
            Conversation((), "Hello there, how are you today?", "Fine, thanks for asking."),
            Conversation((one,), "What is in the picture?", "A pattern of colours."),
            Conversation(two, "Compare these two images.", "The first one is wider."),
            Conversation((), "Count to three.", "One, two, three."),
        ),
        "B": (
            Conversation((tall,), "Describe the tall image.", "A tall pattern."),
            Conversation((), "Say hi.", "Hi."),
        ),
    }


# --- the row's layout ----------------------------------------------------------------------------


def assert_slots(batch: PackedBatch, samples: Sequence[Sample], pad_to_multiple_of: int | None = None) -> None:
    """One slot per sample, of its processor length; padding tokens exactly when slots are padded."""
    lengths = [s.input_ids.shape[1] for s in samples]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    if pad_to_multiple_of is not None:
        assert (batch.num_tokens > batch.num_real_tokens) == (pad_to_multiple_of > 1)


def assert_restarting_positions(batch: PackedBatch, rows: int = 1) -> None:
    """Text positions restart at every (padded) slot: 1-D rotary ``[1, T]`` is 0.. per slot;
    mRoPE ``[4, 1, T]`` (rows 4) is each sample's own rope index, checked by the truth."""
    if rows == 1:
        cu = batch.cu_seqlens_padded.tolist()
        assert batch.position_ids.tolist() == [[p for a, b in zip(cu[:-1], cu[1:]) for p in range(b - a)]]
    else:
        assert batch.position_ids.shape == (rows, 1, batch.num_tokens)


def assert_vision_joined(batch: PackedBatch, samples: Sequence[Sample], dims: Mapping[str, int]) -> None:
    """The row's vision keywords are ``dims``'s keys only, each the samples' own processor outputs
    joined along its dim, in token order (nothing padded, reordered or recomputed)."""
    vision = batch.vision_inputs()  # 8-bit pixels as the model gets them: bit-equal to the processor's
    assert set(vision) == set(dims)
    for key, dim in dims.items():
        want = torch.cat([s.inputs[key] for s in samples if key in s.inputs], dim=dim)
        assert torch.equal(vision[key], want), key


def model_blocks(samples: Sequence[Sample], batch: PackedBatch, key: str = "mm_token_type_ids") -> list[list[int]]:
    """The model's own image blocks: runs of the processor's ``key == 1``, placed at each slot."""
    spans = []
    for sample, start in zip(samples, batch.cu_seqlens_padded.tolist()):
        spans += [[start + a, start + b] for a, b in token_runs(sample.inputs[key][0].numpy(), 1)]
    return spans


# --- the claim -----------------------------------------------------------------------------------


def two_packs(setup: Setup, pad_to_multiple_of: int = 1, names: tuple[str, str] = ("A", "B")) -> PackedBatch:
    """``--packs-per-microbatch 2``: the two packs encoded alone and joined by `concat_batches`,
    keys and sample count kept (the caller asserts it equals their samples alone)."""
    parts = [setup.encode(name, pad_to_multiple_of) for name in names]
    batch = concat_batches(parts, setup.encoder.joins)
    assert batch.pack_keys == tuple(f"pack-{n}" for n in names)
    assert batch.num_samples == len(setup.samples_of(*names))
    return batch


def split_pack(
    setup: Setup, name: str, first: Sequence[int], second: Sequence[int], pads: tuple[int, int] = (1, 16)
) -> PackedBatch:
    """Pack ``name``'s samples as two packs (``first`` and ``second``: their indices, in that order;
    slots padded to ``pads``) joined by `concat_batches`: one row, the samples in ``first + second`` order."""
    parts = [
        setup.encode(name, pad, order=order, key=key)
        for order, pad, key in zip((first, second), pads, ("pack-a", "pack-b"))
    ]
    batch = concat_batches(parts, setup.encoder.joins)
    assert batch.pack_keys == ("pack-a", "pack-b") and batch.num_samples == len(first) + len(second)
    return batch


# --- mutations -----------------------------------------------------------------------------------


def with_vision(batch: PackedBatch, **tensors: torch.Tensor) -> PackedBatch:
    """``batch`` with those vision keywords replaced (a mutation; the batch itself is never changed)."""
    return dataclasses.replace(batch, vision=batch.vision | tensors)


def assert_mutation_moves(setup: Setup, pack: str, mutated: PackedBatch, large: float = LARGE) -> None:
    """The varlen path on ``mutated`` moves some per-token loss of ``pack`` by more than ``large``."""
    assert loss_diff(setup.truth[pack], mutated, varlen_losses(setup, mutated)) > large


def assert_one_slot_mixes(setup: Setup, pack: str = "A", large: float = LARGE) -> None:
    """The whole row as one attention slot mixes the samples."""
    batch = setup.encode(pack)
    assert loss_diff(setup.truth[pack], batch, varlen_losses(setup, one_slot(batch))) > large


def assert_positions_path_exact(setup: Setup, pack: str = "A") -> None:
    """The oracle of the positions mutations: the path that infers boundaries from position_ids
    (no boundaries passed) packs exactly with the layout's positions."""
    batch = setup.encode(pack)
    assert loss_diff(setup.truth[pack], batch, positions_losses(setup, batch)) <= TOLERANCE


def assert_continuing_positions_mix(setup: Setup, pack: str = "A", large: float = LARGE) -> None:
    """Positions 0..T-1 over the whole row on that path: the samples continue each other."""
    mutated = continuing_positions(setup.encode(pack))
    assert loss_diff(setup.truth[pack], mutated, positions_losses(setup, mutated)) > large


def sliding_window_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation of the block-attention rule: every layer attends without its sliding window."""
    original = block_attention.allowed
    monkeypatch.setattr(
        block_attention, "allowed", lambda q, kv, slots, blocks, window: original(q, kv, slots, blocks, None)
    )
