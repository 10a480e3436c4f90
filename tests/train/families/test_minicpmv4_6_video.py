"""MiniCPM-V 4.6 video packed: equal to each sample alone (CPU, fp32), against the real processor.

The truth is each conversation alone through the *real* ``MiniCPMV4_6Processor`` (its video
processor loading the clip from its path with transformers' PyAV reader and sampling frames
itself, as `tests/train/test_video.py` does for Qwen) and the unmodified model (transformers' own
linear attention, stock SDPA). The pack is what `prep` stores: the closed-form ids
(`prep.tokenize.core.SampleTokenizer`, checked equal to the processor's here too) and each item's
planned grid, pieces, tokens and frame indices; `PackEncoder` decodes the planned frames and runs
the layout. One row holds a text-only sample, an unsliced two-second clip, and a sample with a
sliced image and a clip of sliced frames (``<image_id>0</image_id>`` once per kind): its per-token
losses must equal the samples alone within 1e-5 and its gradients within rtol = atol = 1e-5 (fp32
sums over a few hundred tokens; `tests.train.models.max_grad_error`), and its video pixels must be
the processor's bit for bit. Mutation: the video's pieces read as (w, h) move the losses.
With ``stack_frames`` > 1 the layout refuses video (the canvases need the sampling's max_num_frames).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.torchvision  # CI runs it in its Python 3.12 environment
pytest.importorskip("torchvision")
pytest.importorskip("av")

from PIL import Image  # noqa: E402
from transformers.image_utils import load_image  # noqa: E402

from families.processor import load_processor  # noqa: E402
from prep.sources.conversation import Conversation, MediaItem  # noqa: E402
from prep.tokenize.core import SampleTokenizer  # noqa: E402
from schemas.dataset_config import VideoSampling  # noqa: E402
from schemas.media_ref import MediaRef  # noqa: E402
from tests.train.families.test_qwen3_5 import long_memory, modeling_modules, unmodified_transformers  # noqa: E402
from tests.train.models import (  # noqa: E402
    counted_item,
    grads_of,
    loaded_pack,
    make_family,
    max_grad_error,
    processed,
    reference,
    scatter_truth,
    tiny_model,
    turns,
)
from tests.video_clips import Clip, real_processor, write_clips  # noqa: E402
from train.batch import IGNORE_INDEX  # noqa: E402
from train.encoder import PackEncoder  # noqa: E402
from train.forward import packed_forward  # noqa: E402
from train.loss import per_token_losses, token_loss_sum  # noqa: E402

TOLERANCE = 1e-5
KEYS = ("input_ids", "pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos")
CLIPS = {
    "a": Clip(8, 4.0, 64, 48, seed=1),  # 2 s: frames 0, 4, unsliced
    "b": Clip(5, 2.0, 500, 460, seed=2),  # 2.5 s: frames 0, 2, 4, each 1x2 slices
}


class Alone:
    """One conversation through the real processor: `tests.train.models.reference`'s sample."""

    def __init__(self, processor: Any, media: list[Path], question: str, answer: str) -> None:
        user, reply = turns(["video" if p.suffix == ".mp4" else "image" for p in media], question, answer)
        images = [load_image(str(p)) for p in media if p.suffix != ".mp4"] or None
        videos = [str(p) for p in media if p.suffix == ".mp4"] or None
        full, self.loss_mask = processed(processor, user, reply, images=images, videos=videos)
        self.inputs = {k: full[k] for k in KEYS if k in full}
        self.input_ids = self.inputs["input_ids"]
        self.labels = torch.where(self.loss_mask.bool()[None], self.input_ids, IGNORE_INDEX)
        self.media = media
        self.conversation = Conversation(
            messages=user + reply,
            media=[
                MediaItem(kind="video" if p.suffix == ".mp4" else "image", ref=MediaRef(path=str(p))) for p in media
            ],
        )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("minicpmv4_6_video_train")
    torch.manual_seed(0)
    tiny = make_family("minicpmv4_6", root)
    processor = real_processor(tiny.processor_dir)
    image = root / "wide.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 600, 3), dtype=np.uint8)).save(image)
    clip_a, clip_b = write_clips(root, CLIPS).values()
    samples = [
        Alone(processor, [], "Hello there, how are you?", "Fine, thanks."),
        Alone(processor, [clip_a], "What happens in the clip?", "Colours move slowly."),
        Alone(processor, [image, clip_b], "Compare the picture and the clip.", "The clip moves."),
    ]
    model = tiny_model(tiny)
    long_memory(model)
    with unmodified_transformers(modeling_modules(model)):
        truth = reference(model, samples)  # type: ignore[arg-type]
    tokenizer = SampleTokenizer(load_processor(str(tiny.processor_dir)))
    tokenized = [tokenizer.tokenize(s.conversation, VideoSampling()) for s in samples]
    media = []
    for i, (sample, tok) in enumerate(zip(samples, tokenized, strict=True)):
        for path, (_, count) in zip(sample.media, tok.media, strict=True):
            member = f"{count.kind}{len(media):04d}{path.suffix}"
            media.append(counted_item(path.read_bytes(), count, sample=i, member=member))
    pack = loaded_pack(
        key="pack-video",
        input_ids=np.concatenate([np.asarray(t.input_ids) for t in tokenized]),
        loss_mask=np.concatenate([np.asarray(t.loss_mask) for t in tokenized]),
        lengths=[t.num_tokens for t in tokenized],
        sample_ids=["text", "clip", "image+clip"],
        media=media,
        pad_to_multiple_of=16,
    )
    encoder = PackEncoder.from_pretrained(str(tiny.processor_dir), str(tiny.model_dir))
    return {"samples": samples, "tokenized": tokenized, "model": model, "truth": truth, "batch": encoder.encode(pack)}


def test_closed_form_ids_and_mask_are_the_processors(setup):
    for sample, tok in zip(setup["samples"], setup["tokenized"], strict=True):
        assert tok.input_ids == sample.input_ids[0].tolist()
        assert np.array_equal(np.asarray(tok.loss_mask), sample.loss_mask.numpy())
    grids = [(c.grid_t, c.grid_h, c.grid_w, c.num_tiles) for t in setup["tokenized"] for _, c in t.media]
    assert grids == [(2, 0, 0, 2), (1, 1, 2, 3), (3, 1, 2, 9)]


def test_video_pixels_are_the_processors(setup):
    batch, samples = setup["batch"], setup["samples"]
    with_video = [s for s in samples if "pixel_values_videos" in s.inputs]
    assert torch.equal(
        batch.vision["pixel_values_videos"], torch.cat([s.inputs["pixel_values_videos"] for s in with_video], -1)
    )
    assert torch.equal(
        batch.vision["target_sizes_videos"], torch.cat([s.inputs["target_sizes_videos"] for s in with_video])
    )
    assert torch.equal(batch.pixel_values, samples[2].inputs["pixel_values"])


def test_packed_losses_and_grads_equal_samples_alone(setup):
    model, batch, truth = setup["model"], setup["batch"], setup["truth"]
    model.zero_grad(set_to_none=True)
    logits = packed_forward(model, batch)
    losses = per_token_losses(logits, batch.labels).reshape(-1).detach()
    assert float((losses - scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)).abs().max()) <= TOLERANCE
    summed, _ = token_loss_sum(logits, batch.labels)
    summed.backward()
    packed = grads_of(model)
    model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, truth.grads) <= TOLERANCE
    assert any("vision_tower" in n and float(g.abs().max()) > 0 for n, g in packed.items())


@torch.no_grad()
def test_mutation_video_pieces_transposed_move_the_losses(setup):
    model, batch, truth = setup["model"], setup["batch"], setup["truth"]
    sizes = batch.vision["target_sizes_videos"]
    assert bool((sizes[:, 0] != sizes[:, 1]).any())
    mutated = dataclasses.replace(batch, vision={**batch.vision, "target_sizes_videos": sizes.flip(-1).contiguous()})
    losses = per_token_losses(packed_forward(model, mutated), batch.labels).reshape(-1)
    assert float((losses - scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)).abs().max()) > 1e-3


def test_stacked_video_is_refused_for_training(tmp_path):
    """stack_frames > 1: the canvases depend on the sampling's max_num_frames, which a pack does not hold."""
    import json

    from families.minicpmv4_6.layout import MiniCPMV4_6Layout

    tiny = make_family("minicpmv4_6", tmp_path)
    assert MiniCPMV4_6Layout.from_bundle(load_processor(str(tiny.processor_dir))).supports_video
    path = tiny.processor_dir / "video_preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text("utf-8")), "stack_frames": 2}), "utf-8")
    layout = MiniCPMV4_6Layout.from_bundle(load_processor(str(tiny.processor_dir)))
    assert not layout.supports_video and layout.missing_video_package is None
    assert "stack_frames 2" in layout.no_video_reason
