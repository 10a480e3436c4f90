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
from pathlib import Path

import pytest
import torch

from prep.tokenize.processor import load_processor
from schemas.packed import LoadedPack
from tests.train.models import (
    CONVERSATIONS,
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
from train.families.pixtral import PixtralLayout
from train.forward import packed_forward, packed_inputs
from train.loss import per_token_losses, token_loss_sum
from train.media import PlanMismatchError

TOLERANCE = 1e-5  # the bound for losses and gradients (fp32)
LARGE = 1e-2  # a mutation must move some per-token loss by 1000x the tolerance at least
FAMILIES = ("pixtral", "mistral3")
#: pack B: 1600 x 24 exceeds both longest edges (1024, 1540): downscaled; 60 x 150 is taller than pack A
PACK_B = (
    Conversation(((1600, 24),), "Read the strip.", "A thin band of colour."),
    Conversation((), "Say hi.", "Hi."),
    Conversation(((60, 150), (130, 40)), "Which is taller?", "The first image is taller."),
)
PACKS = {"A": CONVERSATIONS, "B": PACK_B}


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


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    family = make_family(request.param, tmp_path_factory.mktemp(request.param))
    processor = load_processor(str(family.processor_dir)).processor
    samples = {name: [process(processor, c) for c in convs] for name, convs in PACKS.items()}
    model = tiny_model(family)
    truth = {name: reference(model, s) for name, s in samples.items()}
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    return Setup(model, samples, truth, encoder, family.processor_dir)


def truth_of(setup: Setup, *names: str) -> Truth:
    """Several packs' truths as one row's (per-sample losses in order, gradients summed)."""
    parts = [setup.truth[n] for n in names]
    grads = {k: sum(p.grads[k] for p in parts) for k in parts[0].grads}
    return Truth([loss for p in parts for loss in p.losses], grads)


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
    assert max_grad_error(packed, truth.grads) <= TOLERANCE  # allclose, rtol = atol = 1e-5
    assert len(packed) == sum(1 for _ in setup.model.parameters())  # every parameter, vision tower too
    assert any("vision_tower" in name and float(g.abs().max()) > 0 for name, g in packed.items())


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
    pixels = batch.vision["pixel_values"]
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
    lengths = [s.input_ids.shape[1] for s in samples]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch.position_ids.shape == (1, batch.num_tokens)  # 1-D rotary: restarting text positions
    assert (batch.num_tokens > batch.num_real_tokens) == (pad_to_multiple_of > 1)
    assert set(batch.vision) == {"pixel_values", "image_sizes"}
    assert_vision_is_the_processors(batch, samples)
    assert_equals_alone(setup, batch, setup.truth[pack], samples)


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_two_packs_per_microbatch_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    """``--packs-per-microbatch 2``: pack A's images padded to pack B's larger ones in one tensor."""
    a, b = (setup.encode(name, pad_to_multiple_of) for name in ("A", "B"))
    batch = concat_batches([a, b], setup.encoder.joins)
    samples = setup.samples["A"] + setup.samples["B"]
    assert batch.pack_keys == ("pack-A", "pack-B") and batch.num_samples == len(samples)
    assert batch.vision["pixel_values"].shape[2] > a.vision["pixel_values"].shape[2]  # A's images padded more
    assert_vision_is_the_processors(batch, samples)
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


def test_mutation_dropping_a_samples_image_sizes_fails(setup: Setup) -> None:
    """Sample 1's single image loses its ``image_sizes`` row: the tower embeds the wrong images."""
    batch = setup.encode("A")
    sizes = batch.vision["image_sizes"]
    mutated = dataclasses.replace(batch, vision=batch.vision | {"image_sizes": sizes[1:]})
    with pytest.raises(ValueError, match="do not match"):
        varlen_losses(setup, mutated)
    without = dataclasses.replace(batch, vision={"pixel_values": batch.vision["pixel_values"]})
    with pytest.raises((ValueError, TypeError)):  # LLaVA: every image at full padded size; Mistral 3: required
        varlen_losses(setup, without)


def test_mutation_swapped_image_sizes_move_the_losses(setup: Setup) -> None:
    """Sample 2's two images swap sizes: the same token total, so no count check can fire."""
    batch = setup.encode("A")
    sizes = batch.vision["image_sizes"].clone()
    sizes[[1, 2]] = sizes[[2, 1]]
    mutated = dataclasses.replace(batch, vision=batch.vision | {"image_sizes": sizes})
    assert loss_diff(setup.truth["A"], mutated, varlen_losses(setup, mutated)) > LARGE


@pytest.mark.parametrize("field", ["grid_thw", "num_tokens", "num_tiles"])
def test_a_stored_plan_that_differs_is_a_plan_mismatch(setup: Setup, field: str) -> None:
    pack = setup.pack("B")
    media = list(pack.media)
    meta = media[2].meta  # sample 2's first image
    wrong = {"grid_thw": (1, meta.grid_thw[1] + 2, meta.grid_thw[2]), "num_tokens": meta.num_tokens + 1, "num_tiles": 2}
    media[2] = dataclasses.replace(media[2], meta=dataclasses.replace(meta, **{field: wrong[field]}))
    altered = dataclasses.replace(pack, media=tuple(media))
    want = getattr(meta, field)
    with pytest.raises(PlanMismatchError) as error:
        setup.encoder.encode(altered)
    message = str(error.value)
    assert f"pack pack-B, sample sample-2, member {meta.member}" in message
    assert f"stored {field} {wrong[field]}" in message and f"processor {field} {want}" in message
