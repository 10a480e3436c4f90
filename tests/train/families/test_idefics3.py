"""Idefics3 / SmolVLM packing equivalence: a packed forward/backward equals each sample alone (CPU, fp32).

Tiny random ``Idefics3ForConditionalGeneration`` (example ``idefics3``: Idefics3Processor,
tile 364, 169 tokens a tile) and ``SmolVLMForConditionalGeneration`` (example ``smolvlm``:
SmolVLMProcessor, tile 384, 81 a tile) see four conversations (text-only, one image, two
images, text-only) as one pack built the way `prep pack` stores it (stored grid / tiles /
tokens from the prep counter) and encoded by `PackEncoder`; the truth is each conversation
alone through the real processor (the base ``ProcessorMixin.apply_chat_template``: SmolVLM's
override reads its torchvision-only video processor) and the unmodified model with sdpa.

Two processor settings:

- ``no_resize`` (every test): ``do_resize`` off, so an image within one tile stays whole (grid
  (1, 0, 0), 1 tile) and a larger one splits (2 tiles + global): both kinds in one pack and
  in one sample.
- ``example`` (the equivalence test only, one image between two text-only samples): the
  example's own settings, every image rescaled to the longest edge (1456 / 1536, up) and split;
  an image of aspect 4:1 keeps that to 4 tiles + global (idefics3: 845 tokens; a square image
  would take 17 tiles, 2873 tokens).

The mutations show what the layout must get right: the tiles in token order along dim 1
(a dropped tile fails the model's own feature count check, reordered tiles move the loss),
per-sample restarting positions (continuing positions mix samples on the positions path).
``pixel_attention_mask`` is all ones for every real tile these processors make (tiles are
always max_image_size square), so dropping it changes nothing; zeroing one tile's mask moves
exactly that sample's losses, which shows the mask reaches the tile it belongs to.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import ProcessorMixin

from families.idefics3.layout import Idefics3Layout
from families.processor import load_processor
from families.registry import find_counter, find_layout
from tests.train.families.harness import (
    TOLERANCE,
    Setup,
    assert_continuing_positions_mix,
    assert_equals_alone,
    assert_mutation_moves,
    assert_plan_mismatch,
    assert_positions_path_exact,
    assert_restarting_positions,
    assert_slots,
    assert_vision_joined,
    build_setup,
    loss_diff,
    split_pack,
    varlen_losses,
    with_vision,
)
from tests.train.models import Conversation, Family, make_family, scatter_truth
from train.batch import PackedBatch

FAMILIES = ("idefics3", "smolvlm")

TEXT_ONLY = (
    Conversation((), "Hello there, how are you today?", "Fine, thanks for asking."),
    Conversation((), "Count to three.", "One, two, three."),
)
#: settings -> (preprocessor_config.json changes, conversations); image sizes are (width, height)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[Conversation, ...]]] = {
    "no_resize": (
        {"do_resize": False},
        (
            TEXT_ONLY[0],
            Conversation(((500, 200),), "What is in the picture?", "A pattern of colours."),
            Conversation(((56, 84), (200, 420)), "Compare these two images.", "The second one is larger."),
            TEXT_ONLY[1],
        ),
    ),
    "example": (
        {},
        (
            TEXT_ONLY[0],
            Conversation(((112, 28),), "What is in the picture?", "A pattern of colours."),
            TEXT_ONLY[1],
        ),
    ),
}
#: per variant: (rows, cols) of each image in token order, as the processor splits them (both families)
GRIDS = {"no_resize": [(1, 2), (0, 0), (2, 1)], "example": [(1, 4)]}
PACK = "no_resize"  # the module fixture's variant: its one pack is named after it


class BaseTemplate:
    """The real processor, rendering with the base ``ProcessorMixin.apply_chat_template``."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.processor(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return ProcessorMixin.apply_chat_template(self.processor, *args, **kwargs)


def base_template(changes: dict[str, Any]) -> Callable[[Family], BaseTemplate]:
    """The processor hook: ``changes`` written into preprocessor_config.json, then loaded and wrapped."""

    def load(family: Family) -> BaseTemplate:
        config_path = family.processor_dir / "preprocessor_config.json"
        config_path.write_text(json.dumps(json.loads(config_path.read_text()) | changes), "utf-8")
        return BaseTemplate(load_processor(str(family.processor_dir)).processor)

    return load


def build_variant(name: str, variant: str, root: Path) -> Setup:
    """Family ``name`` with processor settings ``variant``: one pack named ``variant``."""
    changes, conversations = VARIANTS[variant]
    return build_setup(name, root, {variant: conversations}, vision="vision_model", processor=base_template(changes))


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build_variant(request.param, PACK, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def batch(setup: Setup) -> PackedBatch:
    """The samples as one pack, encoded once (tests replace fields, never mutate)."""
    return setup.encode(PACK)


def sample_diffs(setup: Setup, batch: PackedBatch, losses: torch.Tensor) -> list[float]:
    """Largest |packed - alone| per sample slot."""
    truth = setup.truth[PACK]
    diff = (losses.detach().reshape(-1) - scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)).abs()
    cu = batch.cu_seqlens_padded.tolist()
    return [float(diff[a : b - 1].max()) for a, b in zip(cu[:-1], cu[1:])]


def test_layout_registered_for_both_processors() -> None:
    assert find_layout("Idefics3Processor") is Idefics3Layout
    assert find_layout("SmolVLMProcessor") is Idefics3Layout


def check_layout(setup: Setup, batch: PackedBatch, variant: str) -> None:
    """Restarting 1-D positions; the vision keywords are each sample's real processor outputs, in token order."""
    assert_slots(batch, setup.samples[variant])
    assert_restarting_positions(batch)
    assert_vision_joined(batch, setup.samples[variant], {"pixel_values": 1, "pixel_attention_mask": 1})
    tiles = [r * c + 1 if r else 1 for r, c in GRIDS[variant]]
    assert batch.pixel_values.shape[:2] == (1, sum(tiles))
    assert batch.num_media == len(tiles)


def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, batch: PackedBatch) -> None:
    """Summed-loss gradients reach ~10 here, where fp32 summation order alone moves them ~5e-6:
    compared as ``torch.allclose`` (`tests.train.models.max_grad_error`)."""
    check_layout(setup, batch, PACK)
    assert_equals_alone(setup, batch, PACK)


@pytest.mark.parametrize("name", FAMILIES)
def test_example_settings_pack_exactly(name: str, tmp_path: Path) -> None:
    """The example processor as shipped (every image upscaled and split), padded slots."""
    example = build_variant(name, "example", tmp_path)
    batch = example.encode("example", 16)
    assert batch.num_tokens > batch.num_real_tokens
    check_layout(example, batch, "example")
    assert_equals_alone(example, batch, "example")


def test_stored_plan_is_the_processors(setup: Setup) -> None:
    """The items' stored grid / tiles / tokens (prep's counter) are what the processor split."""
    pack = setup.pack(PACK)
    layout = setup.encoder.media.layout
    assert isinstance(layout, Idefics3Layout)
    seq_len = layout.settings.image_seq_len
    got = [(m.meta.grid_thw, m.meta.num_tiles, m.meta.num_tokens) for m in pack.media]
    want = [((1, r, c), r * c + 1 if r else 1, seq_len * (r * c + 1 if r else 1)) for r, c in GRIDS[PACK]]
    assert [(tuple(g), t, n) for g, t, n in got] == want


def test_concat_batches_of_two_packs_equals_samples_alone(setup: Setup) -> None:
    """`--packs-per-microbatch 2`: two packs joined along the row and along the tile dim."""
    batch = split_pack(setup, PACK, (0, 1), (2, 3))
    assert batch.num_tokens > batch.num_real_tokens
    check_layout(setup, batch, PACK)
    assert_equals_alone(setup, batch, PACK)


def test_positions_path_is_exact_too(setup: Setup) -> None:
    """The oracle of the positions mutation: restarting 1-D positions pack exactly with stock SDPA."""
    assert_positions_path_exact(setup, PACK)


def test_mutation_continuing_positions_mixes_samples(setup: Setup) -> None:
    assert_continuing_positions_mix(setup, PACK)


def test_mutation_dropped_tile_fails(setup: Setup, batch: PackedBatch) -> None:
    """One tile fewer than the text's placeholders: the model's own feature count check fires
    (transformers 5.13+; 5.8 - 5.12 fail in the scatter that follows, with a torch error)."""
    vision = {k: v[:, :-1] for k, v in batch.vision_inputs().items()}
    with pytest.raises((ValueError, RuntimeError, IndexError)) as err:
        varlen_losses(setup, dataclasses.replace(batch, vision=vision))
    if err.type is ValueError:
        assert "Image features and image tokens do not match" in str(err.value)


def test_mutation_tiles_out_of_token_order_move_the_loss(setup: Setup, batch: PackedBatch) -> None:
    """Images joined in the wrong order (the last image's tiles first): same count, wrong pixels."""
    n = last_image_tiles(PACK)
    vision = {k: torch.cat([v[:, -n:], v[:, :-n]], dim=1) for k, v in batch.vision_inputs().items()}
    assert_mutation_moves(setup, PACK, with_vision(batch, **vision))


def last_image_tiles(variant: str) -> int:
    rows, cols = GRIDS[variant][-1]
    return rows * cols + 1 if rows else 1


def test_pixel_attention_mask_reaches_its_tiles(setup: Setup, batch: PackedBatch) -> None:
    """All ones for real tiles (dropping it is a no-op); zeroing the lower half of the last image's
    tile masks moves the losses of the sample that image belongs to, and of no other sample."""
    assert bool(batch.vision["pixel_attention_mask"].bool().all())
    dropped = {"pixel_values": batch.pixel_values}
    losses = varlen_losses(setup, dataclasses.replace(batch, vision=dropped))
    assert loss_diff(setup.truth[PACK], batch, losses) <= TOLERANCE
    mask = batch.vision["pixel_attention_mask"].clone()
    mask[0, -last_image_tiles(PACK) :, mask.shape[-2] // 2 :] = 0
    mutated = dataclasses.replace(batch, vision={**batch.vision, "pixel_attention_mask": mask})
    owner = max(i for i, s in enumerate(setup.samples[PACK]) if s.conversation.image_sizes)
    diffs = sample_diffs(setup, batch, varlen_losses(setup, mutated))
    assert diffs[owner] > 100 * TOLERANCE
    assert all(d <= TOLERANCE for i, d in enumerate(diffs) if i != owner)


@pytest.mark.parametrize(
    "field, change",
    [("num_tiles", lambda m: m.num_tiles + 1), ("grid_thw", lambda m: (1, m.grid_thw[2], m.grid_thw[1]))],
)
def test_plan_mismatch_names_pack_sample_member_and_values(setup: Setup, field: str, change: Any) -> None:
    pack = setup.pack(PACK, key="pack-7")
    index = len(pack.media) - 1  # the last image: sample 2's second
    assert pack.media[index].meta.sample == 2
    assert_plan_mismatch(setup, pack, index, field, change(pack.media[index].meta))


@pytest.mark.parametrize("name", FAMILIES)
def test_black_and_mean_grey_tiles_are_not_dropped_as_padding(name: str, tmp_path: Path) -> None:
    """The model drops all-zero images (``real_images_inds``); with the checkpoints' mean/std 0.5 and
    rescale 1/255 no 8-bit pixel normalises to 0, so no real tile of a black or grey image is all zero."""
    family = make_family(name, tmp_path)
    bundle = load_processor(str(family.processor_dir))
    layout = dataclasses.replace(Idefics3Layout.from_bundle(bundle), pixel_kwargs={})  # the processor's floats
    counter = find_counter(bundle.processor_class)
    assert counter is not None
    for colour in ((0, 0, 0), (127, 127, 127), (128, 128, 128)):
        item = layout.sample_inputs([Image.new("RGB", (120, 30), colour)], []).items[0]
        pixels = item.tensors["pixel_values"].reshape(item.num_tiles, -1)
        assert bool((pixels != 0).any(dim=1).all()), colour
        count = counter(bundle).count_image(120, 30)
        assert (item.grid_thw, item.num_tiles, item.num_tokens) == (
            (count.grid_t, count.grid_h, count.grid_w),
            count.num_tiles,
            count.num_tokens,
        )
    assert np.isclose(float(item.tensors["pixel_values"].abs().min()), 1 / 255, atol=1e-6)
