"""The training VIDEO path against the real HF video processors (needs torchvision).

Skipped (never passed) where torchvision is missing, i.e. in CPU CI with plain torch. Run it in
an environment whose torch has a matching torchvision (CUDA wheels also run on CPU)::

    python -m pytest tests/train/test_video.py

The truth is the real processor (`AutoProcessor`, its own video processor) loading each video
from its *path* and sampling frames itself, with the dataset's sampling settings: transformers'
own PyAV reader (``load_video(backend="pyav")``; its default torchcodec needs system FFmpeg)
decodes the file, its ``sample_frames`` picks the frames, its metadata gives Qwen2.5-VL's
``second_per_grid_ts`` and Qwen3-VL's ``"<t seconds>"`` timestamp text. Against it, for the
example videos tokenized and packed with the qwen2_vl, qwen2_5_vl and qwen3_vl processors,
`PackEncoder` must give the stored grids, the same ``pixel_values_videos`` bit for bit, the same
``second_per_grid_ts``, and the stored token ids must hold the processor's expansion of each
video (timestamps included). A tiny model then checks that a packed video sample's per-token
losses equal the sample run alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prep.run import LOCAL

pytestmark = pytest.mark.torchvision  # CI runs it in its Python 3.12 environment (.ci/py312-tests)
pytest.importorskip("torchvision")
av = pytest.importorskip("av")

from megatron.energon import WorkerConfig, get_loader, get_train_dataset  # noqa: E402
from transformers.video_utils import load_video  # noqa: E402

from packvlm.energon import PackedTaskEncoder  # noqa: E402
from prep.example.dataset import VIDEO_SAMPLING  # noqa: E402
from prep.example.media import write_video  # noqa: E402
from schemas.packed import LoadedPack  # noqa: E402
from tests.shards.oracles import pack, tokenized_rows  # noqa: E402
from tests.train.conftest import _dataset_config  # noqa: E402
from tests.train.models import (  # noqa: E402
    Sample,
    loaded_pack,
    make_family,
    media_item,
    processed,
    reference,
    scatter_truth,
    tiny_model,
    turns,
)
from tests.video_clips import Clip, real_processor, write_clips  # noqa: E402
from train.encoder import PackEncoder  # noqa: E402
from train.forward import packed_forward  # noqa: E402
from train.loss import per_token_losses  # noqa: E402
from train.media import MediaOrigin, decode_video_frames  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TOLERANCE = 1e-5
PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # what the chat template writes per video
CLIPS = {"a": Clip(8, 4.0, 64, 48, seed=1), "b": Clip(12, 6.0, 96, 64, seed=2)}


def sampling_kwargs() -> dict:
    """The example dataset's video sampling, as processor keywords."""
    return {"do_sample_frames": True, **VIDEO_SAMPLING}


def _packs(path: Path) -> list[LoadedPack]:
    ds = get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=PackedTaskEncoder(),
    )
    return [sample.pack for sample in get_loader(ds)]


@pytest.fixture(scope="module", params=FAMILIES)
def packed_videos(request, example_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(family, processor dir, tokenized rows, packs) of the example's video rows."""
    from families.qwen2_vl.processor_dir import build_processor_dir
    from prep.energon.index import index_dataset
    from prep.tokenize.stage import TokenizeConfig, run_tokenize

    family = request.param
    root = tmp_path_factory.mktemp(f"video_{family}")
    processor_dir = build_processor_dir(root / "processor", family)
    tokenized = root / "tok"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(_dataset_config(example_dir, root)),
            processor=str(processor_dir),
            output_dir=str(tokenized),
            datasets=("videos",),
            executor=LOCAL,
            max_error_rate=1.0,  # the example has deliberately bad rows
            rows_per_chunk=16,
        )
    )
    out = root / "packed"
    pack([tokenized], out, pack_size=1024, shard_size="3packs")
    index_dataset(out)
    return family, processor_dir, tokenized_rows(tokenized), _packs(out)


def _contains(ids: list[int], block: list[int]) -> bool:
    return any(ids[i : i + len(block)] == block for i in range(len(ids) - len(block) + 1))


def test_pack_encoder_videos_equal_the_real_processor(packed_videos):
    family, processor_dir, rows, packs = packed_videos
    processor = real_processor(processor_dir)
    encoder = PackEncoder.from_pretrained(str(processor_dir), str(processor_dir))
    assert encoder.media.layout.video_processor is not None
    assert encoder.media.layout.settings.second_per_grid_ts == (family == "qwen2_5_vl")
    kwargs = sampling_kwargs()
    checked, frame_counts = 0, set()
    for packed in packs:
        items = [m.meta for m in packed.media if m.meta.kind == "video"]
        if not items:
            continue
        batch = encoder.encode(packed)
        pixels, grids, seconds = [], [], []
        for item in items:
            row = rows[packed.sample_ids[item.sample]]
            own = [m.meta for m in packed.media if m.meta.kind == "video" and m.meta.sample == item.sample]
            ref = [m for m in row["media"] if m["kind"] == "video"][own.index(item)]["ref"]
            truth = processor(text=[PLACEHOLDER], videos=[ref], return_tensors="pt", return_metadata=True, **kwargs)
            assert list(truth["video_metadata"][0].frames_indices) == list(item.frame_indices)
            assert truth["video_grid_thw"][0].tolist() == list(item.grid_thw)
            # the stored ids hold the processor's expansion (Qwen3-VL: its "<t seconds>" text too)
            assert _contains(row["input_ids"], truth["input_ids"][0].tolist()), (family, ref)
            pixels.append(truth["pixel_values_videos"])
            grids.append(truth["video_grid_thw"])
            if "second_per_grid_ts" in truth:
                seconds.extend(float(s) for s in truth["second_per_grid_ts"])
            frame_counts.add(len(item.frame_indices))
            checked += 1
        assert batch.video_grid_thw.tolist() == torch.cat(grids).tolist() == [list(m.grid_thw) for m in items]
        assert batch.video_grid_thw.dtype == torch.int64
        assert torch.equal(batch.pixel_values_videos, torch.cat(pixels))
        if family == "qwen2_5_vl":
            assert batch.vision["second_per_grid_ts"].dtype == torch.float32
            assert batch.vision["second_per_grid_ts"].tolist() == pytest.approx(seconds, abs=1e-6)
        else:
            assert "second_per_grid_ts" not in batch.vision and not seconds
        assert (batch.mm_token_type_ids == 2).sum() == sum(t * h * w // 4 for t, h, w in batch.video_grid_thw.tolist())
    assert checked >= 10 and len(frame_counts) >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_odd_frame_counts_and_unsampled_videos(family, tmp_path):
    """All frames (no sampling: Qwen2.5-VL's second_per_grid_ts from the source fps) and an odd
    sampled count (Qwen3-VL pads the last temporal patch, its timestamps too)."""
    processor_dir = make_family(family, tmp_path).processor_dir
    processor = real_processor(processor_dir)
    encoder = PackEncoder.from_pretrained(str(processor_dir), str(processor_dir))
    path = write_video(tmp_path / "clip.mp4", 11, 6.0, 96, 64, seed=3)
    cases = [{"do_sample_frames": False}, {"do_sample_frames": True, "fps": 3.0}]
    for kwargs in cases:
        truth = processor(text=[PLACEHOLDER], videos=[str(path)], return_tensors="pt", return_metadata=True, **kwargs)
        meta = truth["video_metadata"][0]
        indices = list(range(11)) if meta.frames_indices is None else [int(i) for i in meta.frames_indices]
        assert len(indices) % 2 == 1 or (family != "qwen3_vl" and kwargs["do_sample_frames"])  # a padded patch
        grid = tuple(truth["video_grid_thw"][0].tolist())
        item = media_item("video", path.read_bytes(), sample=0, grid_thw=grid, member="v", frame_indices=indices)
        got = encoder.media.process("p", [item], ["s"], 1)
        assert got.tensors["video_grid_thw"].tolist() == [list(grid)]
        assert torch.equal(got.tensors["pixel_values_videos"], truth["pixel_values_videos"])
        if family == "qwen2_5_vl":
            assert got.tensors["second_per_grid_ts"].tolist() == pytest.approx([float(truth["second_per_grid_ts"][0])])
        if family == "qwen3_vl":  # timestamps follow the same indices and source fps we read
            decoded = decode_video_frames(
                path.read_bytes(), indices, MediaOrigin(pack_key="p", sample_id="s", member="v")
            )
            stamps = processor._calculate_timestamps(indices, decoded.fps, 2)
            text = processor.tokenizer.decode(truth["input_ids"][0])
            assert all(f"<{t:.1f} seconds>" in text for t in stamps) and len(stamps) == grid[0]


def _video_sample(processor, path: str, question: str, answer: str, kwargs: dict) -> dict:
    """The real processor on one video conversation: inputs, loss mask, frames for the pack."""
    user, reply = turns(["video"], question, answer)
    full, mask = processed(processor, user, reply, videos=[path], return_tensors="pt", return_metadata=True, **kwargs)
    keys = ("input_ids", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    inputs = {k: full[k] for k in keys if k in full}
    if "second_per_grid_ts" in inputs:
        inputs["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"], dtype=torch.float32)
    meta = full["video_metadata"][0]
    return {"inputs": inputs, "mask": mask, "frames": [int(i) for i in meta.frames_indices], "path": path}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_video_losses_equal_samples_alone(family, tmp_path):
    torch.manual_seed(0)
    tiny = make_family(family, tmp_path)
    processor = real_processor(tiny.processor_dir)
    clips = [str(p) for p in write_clips(tmp_path, CLIPS).values()]
    kwargs = {"fps": 2.0, "do_sample_frames": True}
    samples = [
        _video_sample(processor, clips[0], "What happens in the clip?", "Colours move slowly.", kwargs),
        _video_sample(processor, clips[1], "Describe this video.", "Stripes drift to the right.", kwargs),
    ]
    model = tiny_model(tiny)
    truth = reference(model, [Sample(None, s["inputs"], s["mask"]) for s in samples])  # type: ignore[arg-type]
    lengths = [s["inputs"]["input_ids"].shape[1] for s in samples]
    media = [
        media_item(
            "video",
            Path(s["path"]).read_bytes(),
            sample=i,
            grid_thw=tuple(int(x) for x in s["inputs"]["video_grid_thw"][0]),
            member=f"vid{i:04d}.mp4",
            frame_indices=s["frames"],
        )
        for i, s in enumerate(samples)
    ]
    packed = loaded_pack(
        key="pack-video",
        input_ids=np.concatenate([s["inputs"]["input_ids"][0].numpy() for s in samples]),
        loss_mask=np.concatenate([s["mask"].numpy() for s in samples]),
        lengths=lengths,
        sample_ids=["a", "b"],
        media=media,
    )
    encoder = PackEncoder.from_pretrained(str(tiny.processor_dir), str(tiny.model_dir))
    batch = encoder.encode(packed)
    assert torch.equal(batch.pixel_values_videos, torch.cat([s["inputs"]["pixel_values_videos"] for s in samples]))
    assert torch.equal(
        batch.mm_token_type_ids[0], torch.cat([s["inputs"]["mm_token_type_ids"][0] for s in samples]).long()
    )
    with torch.no_grad():
        losses = per_token_losses(packed_forward(model, batch), batch.labels)
    expected = scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)
    assert float((losses.reshape(-1) - expected).abs().max()) <= TOLERANCE


def test_decoded_frames_equal_transformers_pyav_reader(example_dir):
    """`decode_video_frames` == transformers' own PyAV reader on the same indices (and metadata)."""
    origin = MediaOrigin(pack_key="p", sample_id="s", member="m")
    paths = sorted(p for p in (example_dir / "media" / "videos").glob("*.mp4") if "corrupt" not in p.name)
    assert len(paths) >= 3
    for path in paths:
        with av.open(str(path)) as container:
            total = container.streams.video[0].frames
        indices = sorted({0, total // 3, total - 1})
        frames, meta = load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, _i=indices, **_: _i)
        ours = decode_video_frames(path.read_bytes(), indices, origin)
        assert np.array_equal(ours.frames, np.asarray(frames))
        assert (ours.total_frames, ours.fps) == (meta.total_num_frames, meta.fps)
