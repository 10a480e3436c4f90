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
from prep.tokenize.processor import load_processor
from tests.train.models import (
    Conversation,
    Sample,
    Truth,
    grads_of,
    loaded_pack,
    make_family,
    max_grad_error,
    media_item,
    pack_samples,
    process,
    reference,
    scatter_truth,
    tiny_model,
)
from train.attention import VARLEN_KWARGS
from train.batch import IGNORE_INDEX, PackedBatch, concat_batches
from train.encoder import PackEncoder
from train.forward import packed_forward, packed_inputs
from train.loss import per_token_losses, token_loss_sum
from train.media import PlanMismatchError, VideoProcessorUnavailable

TOLERANCE = 1e-5  # the bound for losses and gradients (fp32)
LARGE = 1e-2  # a silent mutation must move some per-token loss by 1000x the tolerance at least

#: (width, height) of the images: pack A's one-image sample, its two-image sample, pack B's image
IMAGES = {
    # OneVision 384 px tiles: 1+1x2, 1+3x1, 1+1x1 tiles in pack A; 1+2x2 in pack B
    "llava_onevision": (((560, 60),), ((60, 820), (280, 40)), ((760, 400),)),
    # NeXT 336 px tiles: 1+1x2, 1+3x1, 1+2x2 in pack A; 1+1x3 in pack B
    "llava_next": (((660, 40),), ((40, 680), (660, 340)), ((680, 40),)),
}


def conversations(name: str) -> tuple[list[Conversation], list[Conversation]]:
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
    return pack_a, pack_b


@dataclasses.dataclass
class Setup:
    name: str
    model: torch.nn.Module
    samples: list[Sample]  # pack A
    more: list[Sample]  # pack B
    truth: Truth
    more_truth: Truth
    encoder: PackEncoder
    processor_dir: Path
    tmp: Path


@pytest.fixture(scope="module", params=sorted(IMAGES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp(request.param)
    family = make_family(request.param, tmp)
    processor = load_processor(str(family.processor_dir)).processor
    pack_a, pack_b = conversations(request.param)
    samples, more = [process(processor, c) for c in pack_a], [process(processor, c) for c in pack_b]
    model = tiny_model(family)
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    return Setup(
        request.param,
        model,
        samples,
        more,
        reference(model, samples),
        reference(model, more),
        encoder,
        family.processor_dir,
        tmp,
    )


def encode(setup: Setup, samples: list[Sample] | None = None, **kwargs: object) -> PackedBatch:
    return setup.encoder.encode(pack_samples(samples or setup.samples, setup.processor_dir, **kwargs))


def loss_diff(truth: Truth, batch: PackedBatch, losses: torch.Tensor) -> float:
    """Largest |packed - alone| over every predicted position of the row."""
    expected = scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)
    return float((losses.detach().reshape(-1) - expected).abs().max())


@torch.no_grad()
def varlen_losses(setup: Setup, batch: PackedBatch, **overrides: object) -> torch.Tensor:
    """Per-token losses of the varlen path; ``overrides`` replace keywords of the packed call."""
    return per_token_losses(setup.model(**(packed_inputs(setup.model, batch) | overrides)).logits, batch.labels)


@torch.no_grad()
def positions_losses(setup: Setup, batch: PackedBatch) -> torch.Tensor:
    """Per-token losses when transformers infers the boundaries from position_ids (stock SDPA)."""
    inputs = {k: v for k, v in packed_inputs(setup.model, batch).items() if k not in VARLEN_KWARGS}
    setup.model.set_attn_implementation("sdpa")
    try:
        return per_token_losses(setup.model(**inputs).logits, batch.labels)
    finally:
        setup.model.set_attn_implementation("packvlm_varlen")


def fails(setup: Setup, batch: PackedBatch, vision: dict[str, torch.Tensor]) -> bool:
    """The packed forward with ``vision`` replaced either raises (the model's own checks) or is wrong."""
    mutated = dataclasses.replace(batch, vision=vision)
    try:
        losses = varlen_losses(setup, mutated)
    except (ValueError, RuntimeError, TypeError, IndexError):
        return True
    return loss_diff(setup.truth, batch, losses) > LARGE


def image_counts(samples: list[Sample]) -> list[int]:
    return [len(s.conversation.image_sizes) for s in samples]


def test_layout_gives_each_sample_what_the_processor_gives(setup: Setup) -> None:
    """Per sample, the layout's joined tensors equal the real processor's on that sample alone
    (zero tile padding included); across the row, tile counts differ (padding happens)."""
    pack = pack_samples(setup.samples, setup.processor_dir)
    vision = setup.encoder.media.process(pack.key, pack.media, pack.sample_ids, len(setup.samples))
    for sample, got in zip(setup.samples, vision.samples):
        expected = {k: v for k, v in sample.inputs.items() if k != "input_ids"}
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
    if setup.name == "llava_onevision":
        assert setup.samples[2].inputs["batch_num_images"].tolist() == [1, 1]  # flat list: per image
    tiles = [int(s.inputs["pixel_values"].shape[1]) for s in setup.samples if "pixel_values" in s.inputs]
    row = vision.tensors["pixel_values"]
    assert row.shape[:2] == (sum(image_counts(setup.samples)), max(tiles))
    assert (row.flatten(2).abs().sum(-1) == 0).any()  # some image has zero tiles after its own


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
def test_packed_losses_and_grads_equal_samples_alone(setup: Setup, pad_to_multiple_of: int) -> None:
    batch = encode(setup, pad_to_multiple_of=pad_to_multiple_of)
    assert batch.position_ids.shape == (1, batch.num_tokens)
    assert batch.vision["image_sizes"].shape == (sum(image_counts(setup.samples)), 2)
    setup.model.zero_grad(set_to_none=True)
    logits = packed_forward(setup.model, batch)
    assert loss_diff(setup.truth, batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    summed, count = token_loss_sum(logits, batch.labels)
    assert count == sum(int((s.labels[0, 1:] != IGNORE_INDEX).sum()) for s in setup.samples)
    summed.backward()
    packed = grads_of(setup.model)
    setup.model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, setup.truth.grads) <= TOLERANCE
    # the same parameters as alone (the tower's layers after vision_feature_layer get none), tower included
    assert packed.keys() == setup.truth.grads.keys() and "model.image_newline" in packed
    assert any("vision_tower" in n and float(g.abs().max()) > 0 for n, g in packed.items())


def test_two_packs_joined_equal_samples_alone(setup: Setup) -> None:
    """`concat_batches` of packs whose largest tile counts differ: tiles re-padded to the row's largest."""
    first, second = encode(setup), encode(setup, setup.more, key="pack-00000001")
    assert first.vision["pixel_values"].shape[1] != second.vision["pixel_values"].shape[1]
    batch = concat_batches([first, second], setup.encoder.joins)
    truth = Truth(
        setup.truth.losses + setup.more_truth.losses,
        {n: g + setup.more_truth.grads[n] for n, g in setup.truth.grads.items()},
    )
    setup.model.zero_grad(set_to_none=True)
    logits = packed_forward(setup.model, batch)
    assert loss_diff(truth, batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    token_loss_sum(logits, batch.labels)[0].backward()
    packed = grads_of(setup.model)
    setup.model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, truth.grads) <= TOLERANCE


def test_mutations_of_image_metadata_fail(setup: Setup) -> None:
    batch = encode(setup)
    vision = batch.vision
    assert not fails(setup, batch, dict(vision))  # the oracle: unmutated is exact
    assert fails(setup, batch, {k: v for k, v in vision.items() if k != "image_sizes"})
    sizes = vision["image_sizes"].clone()
    sizes[[1, 2]] = sizes[[2, 1]]  # the two-image sample's sizes swapped: tile counts and unpadding move
    assert fails(setup, batch, vision | {"image_sizes": sizes})
    smallest = min(int(s.inputs["pixel_values"].shape[1]) for s in setup.samples if "pixel_values" in s.inputs)
    assert fails(setup, batch, vision | {"pixel_values": vision["pixel_values"][:, :smallest]})


def test_onevision_batch_num_images_is_per_image(setup: Setup) -> None:
    batch = encode(setup)
    if setup.name != "llava_onevision":  # NeXT: the processor returns none and the model takes none
        assert "batch_num_images" not in batch.vision and not any("batch_num_images" in s.inputs for s in setup.samples)
        assert "batch_num_images" not in inspect.signature(type(setup.model).forward).parameters
        return
    vision = batch.vision
    assert vision["batch_num_images"].tolist() == [1] * sum(image_counts(setup.samples))
    per_sample = torch.tensor([n for n in image_counts(setup.samples) if n])  # [1, 2]: nested-list convention
    assert fails(setup, batch, vision | {"batch_num_images": per_sample})
    assert fails(setup, batch, vision | {"batch_num_images": per_sample.sum()[None]})
    dropped = {k: v for k, v in vision.items() if k != "batch_num_images"}  # all ones is the model's default
    assert loss_diff(setup.truth, batch, varlen_losses(setup, dataclasses.replace(batch, vision=dropped))) <= TOLERANCE


def test_positions_path_and_position_mutations(setup: Setup) -> None:
    """Boundaries inferred from position_ids (SDPA without cu_seqlens): exact with restarting
    positions, mixing samples with positions continuing across the row."""
    batch = encode(setup)
    assert loss_diff(setup.truth, batch, positions_losses(setup, batch)) <= TOLERANCE
    whole_row = dataclasses.replace(batch, position_ids=torch.arange(batch.num_tokens)[None])
    assert loss_diff(setup.truth, batch, positions_losses(setup, whole_row)) > LARGE


def test_boundary_and_label_mutations_mix_samples(setup: Setup) -> None:
    batch = encode(setup)
    whole = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    one_slot = dataclasses.replace(batch, cu_seqlens_padded=whole, max_seqlen=batch.num_tokens)
    assert loss_diff(setup.truth, batch, varlen_losses(setup, one_slot)) > LARGE
    labels = batch.labels.clone()
    starts = batch.cu_seqlens_padded[1:-1].long()
    labels[0, starts] = batch.input_ids[0, starts]
    unmasked = dataclasses.replace(batch, labels=labels)
    assert loss_diff(setup.truth, unmasked, varlen_losses(setup, unmasked)) > LARGE


@pytest.mark.parametrize("field", ["num_tiles", "grid_thw", "num_tokens"])
def test_plan_mismatch_names_pack_sample_member_and_both_values(setup: Setup, field: str) -> None:
    pack = pack_samples(setup.samples, setup.processor_dir)
    index = 2  # the two-image sample's second image
    stored = pack.media[index]
    t, h, w = stored.meta.grid_thw
    wrong = {
        "num_tiles": stored.meta.num_tiles + 1,
        "grid_thw": (t, w, h + 1),
        "num_tokens": stored.meta.num_tokens - 1,
    }
    altered = dataclasses.replace(stored, meta=dataclasses.replace(stored.meta, **{field: wrong[field]}))
    media = list(pack.media)
    media[index] = altered
    broken = loaded_pack(
        key=pack.key,
        input_ids=pack.input_ids,
        loss_mask=pack.loss_mask,
        lengths=[s.input_ids.shape[1] for s in setup.samples],
        sample_ids=[f"sample-{i}" for i in range(len(setup.samples))],
        media=media,
    )
    with pytest.raises(PlanMismatchError) as error:
        setup.encoder.encode(broken)
    message = str(error.value)
    have = getattr(stored.meta, field)
    for part in (
        pack.key,
        "sample-2",
        stored.meta.member,
        f"processor {field} {have}",
        f"stored {field} {wrong[field]}",
    ):
        assert str(part).replace(" ", "") in message.replace(" ", ""), (part, message)


def test_video_without_video_processor_names_the_sample(setup: Setup) -> None:
    """A OneVision pack with a video and no loadable video processor (torchvision missing, or
    LLaVA-NeXT, which takes no video) stops on the sample, before any decoding."""
    path = write_video(setup.tmp / "clip.mp4", num_frames=4, fps=2.0, width=64, height=48)
    text = setup.samples[0]
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
