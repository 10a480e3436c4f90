"""Gemma 4 video packed: equal to each sample alone through the unmodified model (CPU; needs torchvision).

The tiny random model of ``prep example --family gemma4`` (one sliding layer, window 16, then
two full layers; ``use_bidirectional_attention: "vision"``) sees packs mixing text-only, image,
image + video and video-only samples, built as `prep tokenize` + `prep pack` store them: each
video's frames, grid and tokens from the closed-form counter (`families.gemma4.counter`,
sampling with the keywords it gives the processor), the encoded file as the pack member.
The truth is each conversation alone through the *real* ``Gemma4Processor`` (its video
processor decoding the file with transformers' PyAV reader and sampling the frames itself) and
the unmodified ``Gemma4ForConditionalGeneration`` with stock SDPA and the processor's
``mm_token_type_ids`` (1 image, 2 video: transformers makes every maximal run of either a
bidirectional block on the sliding layers). `PackEncoder` must give the processor's
``pixel_values_videos``, ``video_position_ids`` and ``num_frames_per_video`` bit for bit and
the model's own blocks: one per image and one per video *frame* (each frame's soft tokens
are closed by ``<image|>``, then its successor's timestamp and ``<|image>``).

Mutations that must fail: the video frames attended causally (only the image blocks kept),
one block over each whole video (timestamps and delimiters included), a stored frame count
that disagrees with the row.

Precision as `tests/train/families/test_gemma4.py` (read there): per-token losses in fp32
within 1e-5; losses and gradients (rtol = atol = 1e-5) with the model in float64, where fp32
summation order alone moves this model's summed-loss gradients by ~3e-5 relative.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import load_image

pytestmark = pytest.mark.torchvision
pytest.importorskip("torchvision")
pytest.importorskip("av")

from families.gemma4.counter import Gemma4Counter  # noqa: E402
from families.gemma4.layout import Gemma4Layout  # noqa: E402
from families.processor import load_processor  # noqa: E402
from prep.example.media import make_image_bytes  # noqa: E402
from prep.sources.media import video_meta  # noqa: E402
from schemas.dataset_config import VideoSampling  # noqa: E402
from schemas.media_ref import MediaRef  # noqa: E402
from schemas.packed import LoadedPack  # noqa: E402
from tests.train.models import (  # noqa: E402
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
from tests.train.packed_truth import (  # noqa: E402
    TOLERANCE,
    Setup,
    assert_equals_alone,
    loss_diff,
    varlen_losses,
    with_stored,
)
from tests.video_clips import read_with_pyav, write_clips  # noqa: E402
from train.encoder import PackEncoder  # noqa: E402
from train.image_blocks import token_runs  # noqa: E402
from train.media import PlanMismatchError  # noqa: E402

LARGE = 1e-3  # a mutation must move some per-token loss by 100x the tolerance at least
# name -> (frames, fps, width, height)
VIDEOS = {"clip": (12, 6.0, 96, 64), "ntsc": (9, 30000 / 1001, 160, 90), "wide": (8, 4.0, 300, 40)}


@dataclasses.dataclass(frozen=True)
class VideoConversation:
    """One user turn (images, then a video if named, then text) and the reply the loss is taken on."""

    image_sizes: tuple[tuple[int, int], ...]
    video: str | None
    question: str
    answer: str
    max_frames: int = 4  # the dataset's sampling: this many frames, uniformly

    def image_bytes(self) -> list[bytes]:
        return [make_image_bytes(w, h, seed=10 * w + h) for w, h in self.image_sizes]

    @property
    def sampling(self) -> VideoSampling:
        return VideoSampling(fps=2.0, max_frames=self.max_frames)


PACKS = {
    "A": (
        VideoConversation((), None, "Hello there, how are you today?", "Fine, thanks for asking."),
        VideoConversation(((56, 56),), "clip", "What happens in the video?", "A pattern of colours moves."),
        VideoConversation((), "ntsc", "Describe the clip.", "Stripes.", max_frames=3),
    ),
    "B": (
        VideoConversation((), "wide", "Tell me a long story about this video.", "Once upon a time " * 4),
        VideoConversation(((90, 60),), None, "Describe the image in detail.", "It is a picture of colours."),
    ),
}


def _processor(family_dir: Path) -> object:
    """The real processor (as `prep` loads it) rendering with ``enable_thinking`` (see test_gemma4.py),
    its video processor decoding paths with transformers' PyAV reader."""
    processor = read_with_pyav(load_processor(str(family_dir)).processor)
    render = processor.apply_chat_template  # type: ignore[attr-defined]
    processor.apply_chat_template = functools.partial(render, enable_thinking=True)  # type: ignore[attr-defined]
    return processor


def _process(processor, counter: Gemma4Counter, conv: VideoConversation, videos: dict[str, Path]) -> Sample:
    """The real processor on one conversation: inputs and the loss mask (everything after the prompt)."""
    media = ["image"] * len(conv.image_sizes)
    kwargs: dict = {}
    if conv.image_sizes:
        kwargs["images"] = [load_image(Image.open(io.BytesIO(b))) for b in conv.image_bytes()]
    if conv.video is not None:
        media.append("video")
        kwargs["videos"] = [str(videos[conv.video])]
        kwargs.update(counter.processor_video_kwargs(conv.sampling))
    full, mask = processed(processor, *turns(media, conv.question, conv.answer), return_tensors="pt", **kwargs)
    inputs = model_inputs(full)
    if "num_frames_per_video" in full:
        inputs["num_frames_per_video"] = torch.as_tensor(full["num_frames_per_video"], dtype=torch.int64)
    return Sample(conv, inputs, mask)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class VideoSetup:
    setup: Setup
    counter: Gemma4Counter
    videos: dict[str, Path]

    def pack(self, name: str, pad_to_multiple_of: int = 1) -> LoadedPack:
        """Pack ``name`` as `prep pack` stores it: each item's grid / frames / tokens from the counter."""
        bundle = load_processor(str(self.setup.processor_dir))
        samples = self.setup.samples[name]
        media = []
        for index, sample in enumerate(samples):
            conv = sample.conversation
            for data in conv.image_bytes():  # type: ignore[attr-defined]
                media.append(stored_image(bundle, data, sample=index, member=f"img{len(media):04d}.jpg"))
            if conv.video is not None:  # type: ignore[attr-defined]
                path = self.videos[conv.video]  # type: ignore[attr-defined]
                count = self.counter.count_video(video_meta(MediaRef(path=str(path))), conv.sampling)  # type: ignore[attr-defined]
                media.append(counted_item(path.read_bytes(), count, sample=index, member=f"vid{len(media):04d}.mp4"))
        return samples_pack(samples, media, key=f"pack-{name}", pad_to_multiple_of=pad_to_multiple_of)

    def encode(self, name: str, pad_to_multiple_of: int = 1):
        return self.setup.encoder.encode(self.pack(name, pad_to_multiple_of))


def _build(root: Path, videos: dict[str, Path], double: bool) -> VideoSetup:
    torch.manual_seed(0)
    family = make_family("gemma4", root)
    processor = _processor(family.processor_dir)
    counter = Gemma4Counter.from_processor(load_processor(str(family.processor_dir)))
    samples = {name: [_process(processor, counter, c, videos) for c in convs] for name, convs in PACKS.items()}
    model = tiny_model(family)
    if double:  # the pixels stay the processor's float32, in the truth as in the pack
        model.double()
    truth = {name: reference(model, s) for name, s in samples.items()}
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    setup = Setup(
        family=family, model=model, samples=samples, truth=truth, encoder=encoder, vision="vision_tower", untouched=()
    )
    return VideoSetup(setup, counter, videos)


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_clips(tmp_path_factory.mktemp("gemma4_videos"), VIDEOS)


@pytest.fixture(scope="module")
def vs(tmp_path_factory: pytest.TempPathFactory, videos: dict[str, Path]) -> VideoSetup:
    return _build(tmp_path_factory.mktemp("gemma4v"), videos, double=False)


@pytest.fixture(scope="module")
def vs64(tmp_path_factory: pytest.TempPathFactory, videos: dict[str, Path]) -> VideoSetup:
    return _build(tmp_path_factory.mktemp("gemma4v64"), videos, double=True)


def model_blocks(samples: list[Sample], starts: list[int]) -> list[list[int]]:
    """The model's own blocks: maximal runs of ``mm_token_type_ids`` 1 or 2, placed at each slot."""
    spans = []
    for sample, start in zip(samples, starts):
        vision = (sample.inputs["mm_token_type_ids"][0] > 0).numpy()
        spans += [[start + a, start + b] for a, b in token_runs(vision, True)]
    return spans


def test_layout_takes_video_with_frame_blocks(vs: VideoSetup) -> None:
    layout = vs.setup.encoder.media.layout
    assert isinstance(layout, Gemma4Layout) and layout.supports_video and layout.video_attention == "bidirectional"
    config = vs.setup.model.config
    assert dict(layout.mm_token_ids) == {1: config.image_token_id, 2: config.video_token_id}


@pytest.mark.parametrize("pad_to_multiple_of", [1, 16])
@pytest.mark.parametrize("pack", list(PACKS))
def test_packed_video_equals_the_processor_and_samples_alone(
    vs: VideoSetup, pack: str, pad_to_multiple_of: int
) -> None:
    batch = vs.encode(pack, pad_to_multiple_of)
    samples = vs.setup.samples[pack]
    blocks = batch.image_blocks.tolist()
    assert blocks == model_blocks(samples, batch.cu_seqlens_padded.tolist()[:-1])
    frames = sum(int(s.inputs["num_frames_per_video"].sum()) for s in samples if "num_frames_per_video" in s.inputs)
    images = sum(len(s.conversation.image_sizes) for s in samples)
    assert len(blocks) == images + frames and frames >= 4  # one block per image and per frame
    assert all(b - a > 16 for a, b in blocks)  # longer than the window
    vision = batch.vision_inputs()  # images ship 8-bit patch rows: compare what the model receives
    for key in ("pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids"):
        parts = [s.inputs[key] for s in samples if key in s.inputs]
        assert torch.equal(vision[key], torch.cat(parts)), key
    counts = [s.inputs["num_frames_per_video"] for s in samples if "num_frames_per_video" in s.inputs]
    assert batch.vision["num_frames_per_video"].tolist() == torch.cat(counts).tolist()
    assert int((batch.mm_token_type_ids == 2).sum()) == sum(
        int((s.inputs["mm_token_type_ids"] == 2).sum()) for s in samples
    )
    assert loss_diff(vs.setup.truth[pack], batch, varlen_losses(vs.setup, batch)) <= TOLERANCE


@pytest.mark.parametrize("pack", list(PACKS))
def test_float64_losses_and_grads_equal_samples_alone(vs64: VideoSetup, pack: str) -> None:
    assert next(vs64.setup.model.parameters()).dtype == torch.float64
    assert_equals_alone(vs64.setup, vs64.encode(pack, 16), pack)


def _video_runs(batch, video_token_id: int) -> list[list[int]]:
    return [[a, b] for a, b in token_runs(batch.input_ids[0].numpy(), video_token_id)]


def test_mutation_video_frames_causal_moves_the_losses(vs: VideoSetup) -> None:
    batch = vs.encode("A")
    video_id = vs.setup.model.config.video_token_id
    frames = _video_runs(batch, video_id)
    kept = [b for b in batch.image_blocks.tolist() if b not in frames]
    assert len(kept) == 1  # the image
    mutated = dataclasses.replace(batch, image_blocks=torch.tensor(kept, dtype=torch.int32))
    assert loss_diff(vs.setup.truth["A"], mutated, varlen_losses(vs.setup, mutated)) > LARGE


def test_mutation_one_block_per_whole_video_moves_the_losses(vs: VideoSetup) -> None:
    batch = vs.encode("A")
    frames = _video_runs(batch, vs.setup.model.config.video_token_id)
    slots = batch.cu_seqlens_padded.tolist()
    by_sample: dict[int, list[list[int]]] = {}
    for a, b in frames:
        by_sample.setdefault(int(np.searchsorted(slots, a, side="right")) - 1, []).append([a, b])
    whole = [[runs[0][0], runs[-1][1]] for runs in by_sample.values()]
    assert len(whole) == 2 and all(len(runs) > 1 for runs in by_sample.values())
    kept = [b for b in batch.image_blocks.tolist() if b not in frames]
    mutated = dataclasses.replace(batch, image_blocks=torch.tensor(sorted(kept + whole), dtype=torch.int32))
    assert loss_diff(vs.setup.truth["A"], mutated, varlen_losses(vs.setup, mutated)) > LARGE


@pytest.mark.parametrize("field", ["grid_thw", "num_tokens", "frame_count"])
def test_a_stored_video_plan_that_differs_is_a_plan_mismatch(vs: VideoSetup, field: str) -> None:
    pack = vs.pack("A")
    index = next(i for i, m in enumerate(pack.media) if m.meta.kind == "video")
    meta = pack.media[index].meta
    t, h, w = meta.grid_thw
    if field == "frame_count":  # one frame fewer stored: the processor gets fewer frames than the row holds
        wrong = with_stored(pack, index, frame_indices=meta.frame_indices[:-1])
        with pytest.raises(PlanMismatchError):
            vs.setup.encoder.encode(wrong)
        return
    changes = {"grid_thw": (t, h, w + 1), "num_tokens": meta.num_tokens + 1}
    with pytest.raises(PlanMismatchError, match=f"stored {field}"):
        vs.setup.encoder.encode(with_stored(pack, index, **{field: changes[field]}))
