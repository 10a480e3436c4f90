"""LLaVA-NeXT and LLaVA-OneVision trained packed: equal to each sample alone (CPU, fp32).

Tiny random `LlavaNextForConditionalGeneration` / `LlavaOnevisionForConditionalGeneration`
(`prep.example`) see a pack of text-only, one-image and two-image samples whose images have
different aspect ratios and anyres tile counts (3, 4 and 2 tiles for OneVision; 3, 4 and 5
for NeXT), so the row's ``pixel_values`` carries zero tiles after the smaller images; a second
pack with a different largest tile count is joined to it by `concat_batches`. The truth is
each sample alone through the real processor (its ``pixel_values``, ``image_sizes`` and, for
OneVision, ``batch_num_images``) and the unmodified model with stock SDPA
(`tests.train.models.reference`). Losses are compared absolutely (1e-5); gradients of the summed
loss with `tests.train.models.max_grad_error` (rtol = atol = 1e-5): the projector bias sums
~5,000 image features to |grad| ~100, where fp32 summation order alone moves 1-2 ulps (1.5e-5).

Mutations that must fail: ``image_sizes`` dropped or swapped between images (the model derives
each image's tile count and unpadding from them), tiles truncated instead of zero-padded,
OneVision's ``batch_num_images`` given per sample or per row instead of per image (the flat-list
convention `prep tokenize` counted), positions continuing across samples, a sample's first
label unmasked, one slot for the whole row. Dropping ``batch_num_images`` is *not* a mutation:
the processor returns all ones for a flat image list, which is the model's own default
(asserted equal below).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from prep.example.media import write_video
from tests.train.families.harness import (
    LARGE,
    TOLERANCE,
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
    loss_diff,
    two_packs,
    unmasked_first_labels,
    varlen_losses,
)
from tests.train.models import Conversation, Sample, loaded_pack, media_item
from train.batch import PackedBatch
from train.media import VideoProcessorUnavailable
from train.pixels import vision_inputs

#: the tower's layers after ``vision_feature_layer`` (the tiny tower's last of 2) and final norm: alone too
UNTOUCHED = ("vision_tower.encoder.layers.1.", "vision_tower.post_layernorm.")
#: (width, height) of the images: pack A's one-image sample, its two-image sample, pack B's image
IMAGES = {
    # OneVision 384 px tiles: 1+1x2, 1+3x1, 1+1x1 tiles in pack A; 1+2x2 in pack B
    "llava_onevision": (((560, 60),), ((60, 820), (280, 40)), ((760, 400),)),
    # NeXT 336 px tiles: 1+1x2, 1+3x1, 1+2x2 in pack A; 1+1x3 in pack B
    "llava_next": (((660, 40),), ((40, 680), (660, 340)), ((680, 40),)),
}


def conversations(name: str) -> dict[str, list[Conversation]]:
    """Pack A: text, one image, two images, text. Pack B: one image, text."""
    one, two, other = IMAGES[name]
    pack_a = [
        Conversation((), "Hello there, how are you today?", "Fine, thanks for asking."),
        Conversation(one, "What is in the picture?", "A pattern of colours."),
        Conversation(two, "Compare these two images.", "The first one is taller than the second."),
        Conversation((), "Count to three.", "One, two, three."),
    ]
    pack_b = [
        Conversation(other, "Describe the image.", "Stripes."),
        Conversation((), "Say yes.", "Yes."),
    ]
    return {"A": pack_a, "B": pack_b}


@pytest.fixture(scope="module", params=sorted(IMAGES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp(request.param)
    return build_setup(request.param, root, conversations(request.param), vision="vision_tower", untouched=UNTOUCHED)


def fails(setup: Setup, batch: PackedBatch, vision: dict[str, torch.Tensor]) -> bool:
    """The packed forward with ``vision`` replaced either raises (the model's own checks) or is wrong."""
    mutated = dataclasses.replace(batch, vision=vision)
    try:
        losses = varlen_losses(setup, mutated)
    except (ValueError, RuntimeError, TypeError, IndexError):
        return True
    return loss_diff(setup.truth["A"], batch, losses) > LARGE


def image_counts(samples: list[Sample]) -> list[int]:
    return [len(s.conversation.image_sizes) for s in samples]


def test_layout_gives_each_sample_what_the_processor_gives(setup: Setup) -> None:
    """Per sample, the layout's keywords equal the real processor's on that sample alone; in the
    row, each image's tiles equal the processor's and the tiles after them are zero (padding)."""
    samples = setup.samples["A"]
    pack = setup.pack("A")
    vision = setup.encoder.media.process(pack.key, pack.media, pack.sample_ids, len(samples))
    for sample, got in zip(samples, vision.samples):  # per sample: all but the pixels (joined once, per pack)
        expected = {k: v for k, v in sample.inputs.items() if k not in ("input_ids", "pixel_values")}
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
    if setup.family.name == "llava_onevision":
        assert samples[2].inputs["batch_num_images"].tolist() == [1, 1]  # flat list: per image
    per_image = [p[None] for s in samples if "pixel_values" in s.inputs for p in s.inputs["pixel_values"]]
    row = vision_inputs(vision.tensors)["pixel_values"]
    assert row.shape[:2] == (sum(image_counts(samples)), max(int(p.shape[1]) for p in per_image))
    for image, want in zip(row, per_image):
        tiles = int(want.shape[1])
        assert torch.equal(image[:tiles], want[0]) and not image[tiles:].any()
    assert any(int(p.shape[1]) < row.shape[1] for p in per_image)  # some image has zero tiles after its own


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = setup.encode("A", pad_to_multiple_of)
    assert_slots(batch, setup.samples["A"], pad_to_multiple_of)
    assert_restarting_positions(batch)  # 1-D rotary
    assert batch.vision["image_sizes"].shape == (sum(image_counts(setup.samples["A"])), 2)
    packed = assert_equals_alone(setup, batch, "A")  # the same parameters as alone (UNTOUCHED: none)
    assert "model.image_newline" in packed


def test_two_packs_joined_equal_samples_alone(setup: Setup) -> None:
    """`concat_batches` of packs whose largest tile counts differ: tiles re-padded to the row's largest."""
    assert setup.encode("A").pixel_values.shape[1] != setup.encode("B").pixel_values.shape[1]
    assert_equals_alone(setup, two_packs(setup), "A", "B")


def test_mutations_of_image_metadata_fail(setup: Setup) -> None:
    batch = setup.encode("A")
    vision = batch.vision_inputs()
    assert not fails(setup, batch, dict(vision))  # the oracle: unmutated is exact
    assert fails(setup, batch, {k: v for k, v in vision.items() if k != "image_sizes"})
    sizes = vision["image_sizes"].clone()
    sizes[[1, 2]] = sizes[[2, 1]]  # the two-image sample's sizes swapped: tile counts and unpadding move
    assert fails(setup, batch, vision | {"image_sizes": sizes})
    pixels = [s.inputs["pixel_values"] for s in setup.samples["A"] if "pixel_values" in s.inputs]
    smallest = min(int(p.shape[1]) for p in pixels)
    assert fails(setup, batch, vision | {"pixel_values": vision["pixel_values"][:, :smallest]})


def test_onevision_batch_num_images_is_per_image(setup: Setup) -> None:
    batch = setup.encode("A")
    samples = setup.samples["A"]
    if setup.family.name != "llava_onevision":  # NeXT: the processor returns none and the model takes none
        assert "batch_num_images" not in batch.vision and not any("batch_num_images" in s.inputs for s in samples)
        assert "batch_num_images" not in inspect.signature(type(setup.model).forward).parameters
        return
    vision = batch.vision_inputs()
    assert vision["batch_num_images"].tolist() == [1] * sum(image_counts(samples))
    per_sample = torch.tensor([n for n in image_counts(samples) if n])  # [1, 2]: nested-list convention
    assert fails(setup, batch, vision | {"batch_num_images": per_sample})
    assert fails(setup, batch, vision | {"batch_num_images": per_sample.sum()[None]})
    dropped = {k: v for k, v in vision.items() if k != "batch_num_images"}  # all ones is the model's default
    losses = varlen_losses(setup, dataclasses.replace(batch, vision=dropped))
    assert loss_diff(setup.truth["A"], batch, losses) <= TOLERANCE


def test_positions_path_and_position_mutations(setup: Setup) -> None:
    """Boundaries inferred from position_ids (SDPA without cu_seqlens): exact with restarting
    positions, mixing samples with positions continuing across the row."""
    assert_positions_path_exact(setup)
    assert_continuing_positions_mix(setup)


def test_boundary_and_label_mutations_mix_samples(setup: Setup) -> None:
    assert_one_slot_mixes(setup)
    assert_mutation_moves(setup, "A", unmasked_first_labels(setup.encode("A")))


@pytest.mark.parametrize("field", ["num_tiles", "grid_thw", "num_tokens"])
def test_plan_mismatch_names_pack_sample_member_and_both_values(setup: Setup, field: str) -> None:
    pack = setup.pack("A")
    index = 2  # the two-image sample's second image
    meta = pack.media[index].meta
    assert meta.sample == 2
    t, h, w = meta.grid_thw
    wrong = {"num_tiles": meta.num_tiles + 1, "grid_thw": (t, w, h + 1), "num_tokens": meta.num_tokens - 1}
    assert_plan_mismatch(setup, pack, index, field, wrong[field])


def test_video_without_video_processor_names_the_sample(setup: Setup, tmp_path: Path) -> None:
    """A OneVision pack with a video and no loadable video processor (torchvision missing, or
    LLaVA-NeXT, which takes no video) stops on the sample, before any decoding."""
    path = write_video(tmp_path / "clip.mp4", num_frames=4, fps=2.0, width=64, height=48)
    text = setup.samples["A"][0]
    video = media_item("video", path.read_bytes(), sample=1, grid_thw=(4, 14, 14), member="vid0000.mp4")
    pack = loaded_pack(
        key="pack-video",
        input_ids=np.concatenate([text.input_ids[0].numpy()] * 2),
        loss_mask=np.concatenate([text.loss_mask.numpy()] * 2),
        lengths=[text.input_ids.shape[1]] * 2,
        sample_ids=["text-only", "with-video"],
        media=[video],
    )
    with pytest.raises(VideoProcessorUnavailable, match="pack pack-video, sample with-video, member vid0000.mp4"):
        setup.encoder.encode(pack)
