"""LFM2-VL packed: a packed forward/backward equals each sample alone (CPU, fp32; needs torchvision).

The tiny random ``Lfm2VlForConditionalGeneration`` of ``prep example --family lfm2_vl`` (SigLIP2
NaFlex tower, pixel unshuffle 2, LFM2 text model with one ``conv`` layer, 3 taps, and one
attention layer) sees packs built the way `prep pack` stores them from the real
``Lfm2VlProcessor`` outputs: text-only, one small image (resized whole, padded patch rows), one
large image (2 tiles of 512 px), two images in one sample (tiles + a small one). The ``thumbnail``
setting (``use_thumbnail`` on) adds each tiled image's thumbnail as a third encoder input; the
``example`` setting is the checkpoint's (no thumbnail). The truth is each conversation alone
through the model with transformers' *own* ``causal_conv1d_fn`` (the hook of
`train.linear_attention` taken out) and stock SDPA.

The conv taps and the conv's input projection (its B / C gates) are redrawn with std 0.5 before
the truth is taken (transformers' init of std 0.02 leaks too little to see at the loss). Mutation:
the conv over the whole row, as the unhooked model runs it: the previous sample's last two tokens
reach the first two of the next. The layer-level checks (both LFM2 short-conv classes, no
torchvision needed) are in ``test_lfm2_short_conv.py``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import PreTrainedModel

from families.lfm2_vl.layout import Lfm2VlLayout
from families.registry import find_layout
from tests.train.families.harness import (
    LARGE,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    loss_diff,
    split_pack,
    stock_processor,
)
from tests.train.models import Conversation, Family, Sample, Truth, reference
from train import linear_attention
from train.batch import PackedBatch
from train.forward import packed_inputs
from train.linear_attention import CONV_FUNCTION, linear_attention_layers
from train.loss import per_token_losses
from train.pixels import PackedPixels

pytestmark = pytest.mark.torchvision
pytest.importorskip("torchvision")

CONVERSATIONS = (
    Conversation((), "Hello there, how are you today?", "Fine, thanks for asking."),
    Conversation(((96, 64),), "What is in the picture?", "A pattern of colours."),
    Conversation(((1100, 600),), "Describe the wide photo.", "Two halves of colour."),
    Conversation(((1100, 600), (56, 84)), "Compare these two images.", "The first one is much wider."),
    Conversation((), "Count to three.", "One, two, three."),
)
#: per image in token order: (rows, cols) as the processor tiles it
GRIDS = [(1, 1), (1, 2), (1, 2), (1, 1)]


def with_thumbnail(family: Family) -> Any:
    """The processor hook: ``use_thumbnail`` on in preprocessor_config.json, then the real processor."""
    import json

    path = family.processor_dir / "preprocessor_config.json"
    path.write_text(json.dumps(json.loads(path.read_text("utf-8")) | {"use_thumbnail": True}), "utf-8")
    return stock_processor(family)


def conv_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in linear_attention_layers(model) if type(m).__name__ == "Lfm2ShortConv"]


def strong_conv(model: PreTrainedModel) -> None:
    """The fixture's weights: conv taps and gates of std 0.5, so a leak shows at the loss (module docstring)."""
    assert len(conv_layers(model)) == 1
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in conv_layers(model):
            layer.conv.weight.normal_(0.0, 0.5, generator=generator)
            layer.in_proj.weight.normal_(0.0, 0.5, generator=generator)


@contextlib.contextmanager
def unmodified_transformers(model: torch.nn.Module) -> Iterator[None]:
    """transformers' own ``causal_conv1d_fn`` back in the LFM2 modeling module."""
    with contextlib.ExitStack() as stack:
        for module in {sys.modules[type(layer).__module__] for layer in conv_layers(model)}:
            hooked = getattr(module, CONV_FUNCTION)
            assert getattr(hooked, "_packvlm_linear_attention", False), "prepare_model_for_packing hooked it"
            stack.enter_context(mock.patch.object(module, CONV_FUNCTION, hooked.__wrapped__))
        yield


def own_reference(model: PreTrainedModel, samples: list[Sample]) -> Truth:
    with unmodified_transformers(model):
        return reference(model, samples)


def build(root: Path, thumbnail: bool) -> Setup:
    return build_setup(
        "lfm2_vl",
        root,
        {"A": CONVERSATIONS},
        vision="vision_tower",
        processor=with_thumbnail if thumbnail else stock_processor,
        prepare=strong_conv,
        truth=own_reference,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build(tmp_path_factory.mktemp("lfm2_vl"), thumbnail=True)


@pytest.fixture(scope="module")
def batch(setup: Setup) -> PackedBatch:
    return setup.encode("A")


def check_layout(setup: Setup, batch: PackedBatch, thumbnail: bool) -> None:
    """Restarting positions; the vision keywords are the samples' processor outputs in token order."""
    assert_slots(batch, setup.samples["A"])
    assert_restarting_positions(batch)
    assert_vision_joined(batch, setup.samples["A"], {"pixel_values": 0, "pixel_attention_mask": 0, "spatial_shapes": 0})
    assert isinstance(batch.vision["pixel_values"], PackedPixels)  # 8-bit patch rows from the worker
    tiles = [r * c + (thumbnail and r * c > 1) for r, c in GRIDS]
    assert batch.vision["pixel_values"].shape[0] == sum(tiles)
    assert bool((batch.vision["pixel_attention_mask"] == 0).any())  # padded patch rows are in the pack


def test_layout_registered() -> None:
    assert find_layout("Lfm2VlProcessor") is Lfm2VlLayout


def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, batch: PackedBatch) -> None:
    check_layout(setup, batch, thumbnail=True)
    assert_equals_alone(setup, batch, "A")


def test_example_settings_pack_exactly(tmp_path: Path) -> None:
    """The checkpoint's settings as shipped (no thumbnail), padded slots."""
    example = build(tmp_path, thumbnail=False)
    batch = example.encode("A", 16)
    assert batch.num_tokens > batch.num_real_tokens
    check_layout(example, batch, thumbnail=False)
    assert_equals_alone(example, batch, "A")


def test_two_packs_in_one_row_equal_samples_alone(setup: Setup) -> None:
    assert_equals_alone(setup, split_pack(setup, "A", (0, 1, 2), (3, 4)), "A")


def test_stored_plan_is_the_processors(setup: Setup) -> None:
    """The items' stored grid / tiles / tokens (prep's counter) are what the processor made."""
    pack = setup.pack("A")
    got = [(tuple(m.meta.grid_thw), m.meta.num_tiles) for m in pack.media]
    assert got == [((1, r, c), r * c + (r * c > 1)) for r, c in GRIDS]


def whole_row_conv(torch_conv, hidden_states, weight, bias, activation, cu):  # noqa: ANN001, ANN201
    """Mutation: the conv over the whole row, as transformers' fallback does (boundaries ignored)."""
    return torch_conv(hidden_states, weight, bias, activation=activation)


def test_mutation_conv_over_the_whole_row_leaks(setup: Setup, batch: PackedBatch, monkeypatch) -> None:
    """The conv over the whole row (no reset): the first two tokens of every later sample change (the
    3-tap conv reads the previous sample's last two), the first sample not at all, and the losses move
    by more than the tolerance (only through attention: prompts carry no loss)."""
    inputs = packed_inputs(setup.model, batch)
    with torch.no_grad():
        ours = setup.model(**inputs).logits[0]
    monkeypatch.setattr(linear_attention, "segmentwise_conv1d", whole_row_conv)
    with torch.no_grad():
        leaked = setup.model(**inputs).logits[0]
    cu = batch.cu_seqlens_padded.tolist()
    assert torch.equal(ours[: cu[1]], leaked[: cu[1]])
    for start in cu[1:-1]:
        assert float((ours[start : start + 2] - leaked[start : start + 2]).abs().max()) > LARGE
    assert loss_diff(setup.truth["A"], batch, per_token_losses(leaked[None], batch.labels)) > 2 * TOLERANCE


def test_unpacked_call_is_transformers_own(setup: Setup) -> None:
    """Without boundaries the hook calls transformers' function: the truth's losses, hooked or not."""
    sample = setup.samples["A"][3]
    hooked = reference(setup.model, [sample])
    assert torch.equal(hooked.losses[0], setup.truth["A"].losses[3])
    assert TOLERANCE > 0
