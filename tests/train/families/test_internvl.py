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

import dataclasses
from pathlib import Path

import pytest
import torch

from prep.tokenize.processor import load_processor
from schemas.packed import LoadedPack
from tests.train.models import (
    Conversation,
    Sample,
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
from train.batch import IGNORE_INDEX, PackedBatch, concat_batches
from train.encoder import PackEncoder
from train.families.base import find_layout
from train.families.internvl import InternVLLayout
from train.forward import packed_forward, packed_inputs
from train.loss import per_token_losses, token_loss_sum
from train.media import PlanMismatchError

TOLERANCE = 1e-5  # the bound for losses (absolute) and gradients (rtol = atol) in fp32
LARGE = 1e-2  # a mutation must move some per-token loss by 1000x the tolerance at least
C = Conversation
PACKS = {
    "A": (
        C((), "Hello there, how are you today?", "Fine, thanks for asking."),
        C(((64, 64),), "What is in the picture?", "A pattern of colours."),
        C(((112, 56), (64, 64)), "Compare these two images.", "The first one is wider."),
        C((), "Count to three.", "One, two, three."),
    ),
    "B": (
        C(((56, 112),), "Describe the tall image.", "A tall pattern."),
        C((), "Say hi.", "Hi."),
    ),
}
TILES = {"A": [1, 3, 1], "B": [3]}  # per image, in token order (the processor's num_patches)


@dataclasses.dataclass
class Setup:
    model: torch.nn.Module
    samples: dict[str, list[Sample]]
    truth: dict[str, Truth]
    encoder: PackEncoder
    processor_dir: Path

    def pack(self, name: str, pad_to_multiple_of: int = 1) -> LoadedPack:
        return pack_samples(
            self.samples[name], self.processor_dir, pad_to_multiple_of=pad_to_multiple_of, key=f"pack-{name}"
        )

    def encode(self, name: str, pad_to_multiple_of: int = 1) -> PackedBatch:
        return self.encoder.encode(self.pack(name, pad_to_multiple_of))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    family = make_family("internvl", tmp_path_factory.mktemp("internvl"))
    processor = load_processor(str(family.processor_dir)).processor
    samples = {name: [process(processor, c) for c in convs] for name, convs in PACKS.items()}
    model = tiny_model(family)
    truth = {name: reference(model, s) for name, s in samples.items()}
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    return Setup(model, samples, truth, encoder, family.processor_dir)


def truth_of(setup: Setup, *names: str) -> Truth:
    """Several packs' truths as one row's (per-sample losses in order, gradients summed)."""
    parts = [setup.truth[n] for n in names]
    return Truth(
        [loss for p in parts for loss in p.losses], {k: sum(p.grads[k] for p in parts) for k in parts[0].grads}
    )


def loss_diff(truth: Truth, batch: PackedBatch, losses: torch.Tensor) -> float:
    """Largest |packed - alone| over every predicted position of the row."""
    expected = scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)
    return float((losses.detach().reshape(-1) - expected).abs().max())


@torch.no_grad()
def varlen_losses(setup: Setup, batch: PackedBatch) -> torch.Tensor:
    return per_token_losses(packed_forward(setup.model, batch), batch.labels)


@torch.no_grad()
def positions_losses(setup: Setup, batch: PackedBatch) -> torch.Tensor:
    """Per-token losses when transformers infers the boundaries from position_ids (stock SDPA)."""
    inputs = {k: v for k, v in packed_inputs(setup.model, batch).items() if k not in VARLEN_KWARGS}
    setup.model.set_attn_implementation("sdpa")
    try:
        return per_token_losses(setup.model(**inputs).logits, batch.labels)
    finally:
        setup.model.set_attn_implementation("packvlm_varlen")


def assert_equals_alone(setup: Setup, batch: PackedBatch, truth: Truth, samples: list[Sample]) -> None:
    """Per-token losses, the summed loss and its gradients (vision tower included) equal the truth."""
    setup.model.zero_grad(set_to_none=True)
    logits = packed_forward(setup.model, batch)
    assert loss_diff(truth, batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    summed, count = token_loss_sum(logits, batch.labels)
    assert count == sum(int((s.labels[0, 1:] != IGNORE_INDEX).sum()) for s in samples)
    assert abs(float(summed.detach()) - float(sum(t.sum() for t in truth.losses))) <= TOLERANCE * count
    summed.backward()
    packed = grads_of(setup.model)
    setup.model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, truth.grads) <= TOLERANCE
    assert len(packed) == sum(1 for _ in setup.model.parameters())  # every parameter, vision tower too
    assert any("vision_tower" in name and float(g.abs().max()) > 0 for name, g in packed.items())


def assert_tiles_are_the_processors(batch: PackedBatch, samples: list[Sample]) -> None:
    """The row's ``pixel_values`` is every sample's own processor output, concatenated in order."""
    want = torch.cat([s.inputs["pixel_values"] for s in samples if "pixel_values" in s.inputs])
    assert set(batch.vision) == {"pixel_values"}
    assert torch.equal(batch.vision["pixel_values"], want)


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
    lengths = [s.input_ids.shape[1] for s in samples]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch.position_ids.shape == (1, batch.num_tokens)  # 1-D rotary: restarting text positions
    assert (batch.num_tokens > batch.num_real_tokens) == (pad_to_multiple_of > 1)
    assert batch.vision["pixel_values"].shape == (sum(TILES["A"]), 3, 448, 448)
    assert_tiles_are_the_processors(batch, samples)
    assert_equals_alone(setup, batch, setup.truth["A"], samples)


def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup) -> None:
    """``--packs-per-microbatch 2``: pack B's tiles follow pack A's in one ``pixel_values``."""
    batch = concat_batches([setup.encode("A", 16), setup.encode("B", 16)], setup.encoder.joins)
    samples = setup.samples["A"] + setup.samples["B"]
    assert batch.pack_keys == ("pack-A", "pack-B") and batch.num_samples == len(samples)
    assert_tiles_are_the_processors(batch, samples)
    assert_equals_alone(setup, batch, truth_of(setup, "A", "B"), samples)


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the positions mutation: restarting positions pack exactly on that path."""
    batch = setup.encode("A")
    assert loss_diff(setup.truth["A"], batch, positions_losses(setup, batch)) <= TOLERANCE


def test_mutation_positions_continuing_across_samples_mixes_them(setup: Setup) -> None:
    batch = setup.encode("A")
    mutated = dataclasses.replace(batch, position_ids=torch.arange(batch.num_tokens)[None])
    assert loss_diff(setup.truth["A"], mutated, positions_losses(setup, mutated)) > LARGE


def test_mutation_one_slot_boundaries_mixes_samples(setup: Setup) -> None:
    batch = setup.encode("A")
    whole = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    mutated = dataclasses.replace(batch, cu_seqlens_padded=whole, max_seqlen=batch.num_tokens)
    assert loss_diff(setup.truth["A"], batch, varlen_losses(setup, mutated)) > LARGE


def test_mutation_dropping_a_tile_fails(setup: Setup) -> None:
    """The thumbnail of sample 2's 3-tile image dropped: 256 placeholders without features."""
    batch = setup.encode("A")
    pixels = batch.vision["pixel_values"]
    mutated = dataclasses.replace(batch, vision={"pixel_values": torch.cat([pixels[:3], pixels[4:]])})
    with pytest.raises(ValueError, match="do not match"):
        varlen_losses(setup, mutated)


def test_mutation_wrong_tile_counts_move_the_losses(setup: Setup) -> None:
    """Sample 2's images taken as 1 + 3 tiles instead of 3 + 1 (its single tile first): the same
    total, so no count check can fire; each placeholder gets another tile's features."""
    batch = setup.encode("A")
    pixels = batch.vision["pixel_values"]  # [A1 | B1 B2 Bthumb | C1]
    reordered = torch.cat([pixels[:1], pixels[4:5], pixels[1:4]])
    mutated = dataclasses.replace(batch, vision={"pixel_values": reordered})
    assert loss_diff(setup.truth["A"], mutated, varlen_losses(setup, mutated)) > LARGE


@pytest.mark.parametrize("field", ["num_tiles", "grid_thw", "num_tokens"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    media = list(pack.media)
    meta = media[1].meta  # sample 2's 3-tile image: canvas 2 x 1
    wrong = {"num_tiles": 2, "grid_thw": (1, 2, 1), "num_tokens": meta.num_tokens - 256}
    media[1] = dataclasses.replace(media[1], meta=dataclasses.replace(meta, **{field: wrong[field]}))
    altered = dataclasses.replace(pack, media=tuple(media))
    with pytest.raises(PlanMismatchError) as error:
        setup.encoder.encode(altered)
    message = str(error.value)
    assert f"pack pack-A, sample sample-2, member {meta.member}" in message
    assert f"stored {field} {wrong[field]}" in message and f"processor {field} {getattr(meta, field)}" in message
