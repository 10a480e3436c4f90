"""Kimi K2.5 VL packed with video: equal to each sample alone (CPU, fp32; the processors need torchvision).

The tiny model of ``prep example --family kimi_k25`` (MoonViT + DeepSeek-V3 MoE) sees one pack
mixing a text-only sample, an image sample, a video sample (11 frames: chunks of 4, 4, 3), one
with an image and two videos, and another video sample, stored as `prep tokenize` + `prep pack`
store them (each video's frames, grid and tokens from `KimiK25Counter.count_video` on the
container header). The truth is each conversation alone through the real ``Kimi_K25Processor``
(decoding the file itself with transformers' PyAV reader, every frame sampled by it) and the
unmodified ``Kimi_K25ForConditionalGeneration`` with stock SDPA.

Why nothing crosses samples: the vision tower takes each ``video_grid_thw`` row (a chunk) as one
clip: attention within its t * h * w patches (``cu_seqlens``, ``merge_temporal=True``), a
per-frame sinusoid, then the chunk's frames averaged (``temporal_merge``) before the 2x2
merger; chunk rows are concatenated in token order, so a chunk never meets another sample's.

Mutations that must fail: positions continuing across samples, the row as one attention slot,
a video's frames regrouped into other chunks (same patch and token counts), two samples' videos
swapped.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.train.models import (
    Sample,
    counted_item,
    make_family,
    model_inputs,
    processed,
    reference,
    samples_pack,
    stored_image,
    tiny_model,
    turns,
)
from tests.train.packed_truth import (
    LARGE,
    TOLERANCE,
    Setup,
    assert_equals_alone,
    continuing_positions,
    loss_diff,
    one_slot,
    positions_losses,
    varlen_losses,
)

pytestmark = pytest.mark.torchvision
pytest.importorskip("torchvision")

from families.kimi_k25.counter import KimiK25Counter  # noqa: E402
from families.processor import load_processor  # noqa: E402
from prep.example.media import make_image_bytes  # noqa: E402
from prep.sources.media import video_meta  # noqa: E402
from schemas.dataset_config import VideoSampling  # noqa: E402
from schemas.media_ref import MediaRef  # noqa: E402
from tests.video_clips import real_processor, write_clips  # noqa: E402
from train.encoder import PackEncoder  # noqa: E402

SAMPLING = VideoSampling(fps=None)  # every frame: 11 -> chunks of 4, 4, 3 (the dataset's fps sampling: tokenize tests)
# (image sizes, video names, question, answer) in the order of the user turn: images, videos, text
CONVERSATIONS = (
    ((), (), "Hello there, how are you?", "Fine, thanks."),
    (((56, 42),), (), "What is in the picture?", "A pattern of colours."),
    ((), ("a",), "What happens in the clip?", "Colours move slowly."),
    (((45, 30),), ("b", "a"), "Compare the picture and both clips.", "The second clip is longer."),
    ((), ("c",), "Describe it.", "Stripes."),
)
VISION_GAIN = 30.0  # the patch embedding scaled up, so the pixels (not the position terms) drive the tower
# One frame moved between two four-frame averages of slowly changing synthetic frames moves the
# losses by ~3e-3 here: the bound is 100x the tolerance (LARGE, 1000x, is for the other mutations)
ONE_FRAME = 100 * TOLERANCE
VIDEOS = {"a": (11, 6.0, 96, 64), "b": (8, 4.0, 96, 64), "c": (6, 25.0, 30, 58)}


def _sample(processor: Any, images: list[bytes], videos: list[Path], question: str, answer: str) -> Sample:
    from PIL import Image
    from transformers.image_utils import load_image

    media = ["image"] * len(images) + ["video"] * len(videos)
    kwargs: dict[str, Any] = {"do_sample_frames": False}
    if images:
        kwargs["images"] = [load_image(Image.open(io.BytesIO(data))) for data in images]
    if videos:
        kwargs["videos"] = [str(p) for p in videos]
    full, mask = processed(processor, *turns(media, question, answer), return_tensors="pt", **kwargs)
    return Sample(None, model_inputs(full), mask)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Setup, Any]:
    root = tmp_path_factory.mktemp("kimi_k25_video")
    torch.manual_seed(0)
    family = make_family("kimi_k25", root)
    processor = real_processor(family.processor_dir)
    paths = write_clips(root, VIDEOS)
    bundle = load_processor(str(family.processor_dir))
    counter = KimiK25Counter.from_processor(bundle)
    samples, media = [], []
    for index, (sizes, names, question, answer) in enumerate(CONVERSATIONS):
        images = [make_image_bytes(w, h, seed=10 * w + h) for w, h in sizes]
        samples.append(_sample(processor, images, [paths[n] for n in names], question, answer))
        for data in images:
            media.append(stored_image(bundle, data, sample=index, member=f"img{len(media):04d}.jpg"))
        for name in names:  # what prep tokenize stores: the counter on the header
            count = counter.count_video(video_meta(MediaRef(path=str(paths[name]))), SAMPLING)
            media.append(counted_item(paths[name].read_bytes(), count, sample=index, member=f"vid{len(media):04d}.mp4"))
    model = tiny_model(family)
    with torch.no_grad():  # random init leaves the vision features a faint part of the embeddings
        model.model.vision_tower.patch_embed.proj.weight.mul_(VISION_GAIN)
    pack = samples_pack(samples, media, key="pack-video")
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    built = Setup(
        family=family,
        model=model,
        samples={"V": samples},
        truth={"V": reference(model, samples)},
        encoder=encoder,
        vision="vision_tower",
        untouched=(),
    )
    return built, pack


def test_video_pixels_and_grids_equal_the_real_processor(setup):
    built, pack = setup
    batch = built.encoder.encode(pack)
    samples = built.samples["V"]
    want_pixels = torch.cat([s.inputs["pixel_values_videos"] for s in samples if "video_grid_thw" in s.inputs])
    want_grids = torch.cat([s.inputs["video_grid_thw"] for s in samples if "video_grid_thw" in s.inputs])
    assert torch.equal(batch.vision["pixel_values_videos"], want_pixels)  # bit for bit
    assert batch.vision["video_grid_thw"].tolist() == want_grids.tolist()
    assert batch.vision["video_grid_thw"].dtype == torch.int64
    # chunks of 4 frames, the last shorter: a (11 frames) is 4, 4, 3 wherever it appears
    assert [r[0] for r in want_grids.tolist()] == [4, 4, 3, 4, 4, 4, 4, 3, 4, 2]
    image_grids = torch.cat([s.inputs["image_grid_thw"] for s in samples if "image_grid_thw" in s.inputs])
    assert batch.vision["image_grid_thw"].tolist() == image_grids.tolist()


def test_packed_losses_and_grads_equal_samples_alone(setup):
    built, pack = setup
    batch = built.encoder.encode(pack)
    assert set(batch.vision) == {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    grads = assert_equals_alone(built, batch, "V")
    assert any("patch_embed" in n and float(g.abs().max()) > 0 for n, g in grads.items())


def test_mutation_positions_continuing_across_samples_mixes_them(setup):
    built, pack = setup
    mutated = continuing_positions(built.encoder.encode(pack))
    assert loss_diff(built.truth["V"], mutated, positions_losses(built, mutated)) > LARGE


def test_mutation_one_slot_boundaries_mixes_samples(setup):
    built, pack = setup
    batch = built.encoder.encode(pack)
    assert loss_diff(built.truth["V"], batch, varlen_losses(built, one_slot(batch))) > LARGE


def test_mutation_a_chunk_taking_the_next_samples_frame_moves_the_losses(setup):
    """Sample 2's last chunk (3 frames) and sample 3's first (4) read as 4 and 3: the same patches and
    tokens, but the clip boundary one frame into the next sample (chunks are the mixing unit)."""
    built, pack = setup
    batch = built.encoder.encode(pack)
    grids = batch.vision["video_grid_thw"].clone()
    assert grids[2:4, 0].tolist() == [3, 4]
    grids[2:4, 0] = torch.tensor([4, 3])
    mutated = dataclasses.replace(batch, vision=batch.vision | {"video_grid_thw": grids})
    assert loss_diff(built.truth["V"], mutated, varlen_losses(built, mutated)) > ONE_FRAME


def test_mutation_chunks_crossing_samples_moves_the_losses(setup):
    """Sample 2's first two chunks (clip a) and sample 3's (clip b, same frame size) trade pixels:
    every shape and count stays valid, each sample reads the other's frames."""
    built, pack = setup
    batch = built.encoder.encode(pack)
    grids, pixels = batch.vision["video_grid_thw"], batch.vision["pixel_values_videos"]
    ends = np.cumsum([0, *grids.prod(dim=1).tolist()]).tolist()
    assert grids[0:2].tolist() == grids[3:5].tolist() == [[4, 6, 8], [4, 6, 8]]
    a, b = pixels[ends[0] : ends[2]], pixels[ends[3] : ends[5]]
    assert not torch.equal(a, b)
    mutated_pixels = torch.cat([b, pixels[ends[2] : ends[3]], a, pixels[ends[5] :]])
    mutated = dataclasses.replace(batch, vision=batch.vision | {"pixel_values_videos": mutated_pixels})
    assert loss_diff(built.truth["V"], mutated, varlen_losses(built, mutated)) > LARGE
