"""Pack -> PackedBatch through Energon's own loader, checked against independent truths.

Truths: the tokenized Arrow parts (read with pyarrow), the original media files / LMDB values
decoded with PIL directly and run through a freshly loaded image processor, PyAV decoding
every frame, transformers' ``get_rope_index`` on real tiny models, hand-computed layouts.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from megatron.energon import WorkerConfig, get_loader, get_train_dataset
from megatron.energon.errors import FatalSampleError, reraise_exception
from megatron.energon.task_encoder.base import get_stateless
from PIL import Image, ImageOps
from transformers import AutoConfig
from transformers.image_utils import load_image
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # not torchvision-gated (5.8 - 5.12)
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from families.qwen2_vl.layout import GridLayout
from packvlm.energon import PackedTaskEncoder
from packvlm.errors import ExitCode
from prep.sources.media import video_meta
from schemas.media_ref import MediaRef
from schemas.packed import LoadedPack
from tests.shards.oracles import original_bytes, tokenized_rows
from train.batch import IGNORE_INDEX, PackedBatch, concat_batches
from train.encoder import PackedBatchTaskEncoder, PackEncoder
from train.media import GridMismatchError, MediaOrigin, VideoPackageMissing, decode_image, decode_video_frames
from train.rope import RopeIndex


def _energon(
    path: Path, task_encoder, num_workers: int = 0, batch_size: int | None = None, reraise: bool = False
) -> list:
    """Everything Energon's own loader yields (repeat=False); ``reraise`` as `train.loader` sets it."""
    extra = {"global_error_handler": reraise_exception} if reraise else {}
    ds = get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=num_workers, **extra),
        batch_size=batch_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=task_encoder,
    )
    return list(get_loader(ds))


def _packs(path: Path) -> list[LoadedPack]:
    """The packs Energon's loader yields, cooked by the shipped hooks."""
    return [sample.pack for sample in _energon(path, PackedTaskEncoder())]


@pytest.fixture(scope="module")
def images(packed_example):
    return packed_example(media="images")


@pytest.fixture(scope="module")
def padded(packed_example):
    return packed_example(media="images", pad_to_multiple_of=8)


@pytest.fixture(scope="module")
def encoder(images) -> PackEncoder:
    return PackEncoder.from_pretrained(str(images.processor), str(images.processor))


def _image_oracle(processor_dir: Path):
    """A freshly loaded PIL image processor and PIL decoding written out by hand."""
    processor = AutoImageProcessor.from_pretrained(str(processor_dir), backend="pil")

    def run(ref: str) -> tuple[torch.Tensor, list[int]]:
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(original_bytes(ref)))).convert("RGB")
        out = processor(images=[image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"][0].tolist()

    return run


def _check_batch_against_tokenized(batch: PackedBatch, rows: dict, pad_id: int, image_oracle) -> None:
    cu, cp = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    assert batch.input_ids.shape == batch.labels.shape == batch.mm_token_type_ids.shape == (1, cp[-1])
    assert batch.position_ids.shape == (4, 1, cp[-1])
    assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.max_seqlen == max(b - a for a, b in zip(cp, cp[1:]))
    ids, labels, text = batch.input_ids[0].tolist(), batch.labels[0].tolist(), batch.position_ids[0, 0].tolist()
    pixels, grids = [], []
    for i, sample_id in enumerate(batch.sample_ids):
        row = rows[sample_id]
        n, start, end = len(row["input_ids"]), cp[i], cp[i + 1]
        assert cu[i + 1] - cu[i] == n
        assert ids[start : start + n] == row["input_ids"]
        assert ids[start + n : end] == [pad_id] * (end - start - n)
        want = [t if m else IGNORE_INDEX for t, m in zip(row["input_ids"], row["loss_mask"])]
        want[0] = IGNORE_INDEX
        assert labels[start:end] == want + [IGNORE_INDEX] * (end - start - n)
        assert text[start:end] == list(range(end - start))
        for item in row["media"]:
            assert item["kind"] == "image"
            got, grid = image_oracle(item["ref"])
            assert grid == [item["grid_t"], item["grid_h"], item["grid_w"]]
            pixels.append(got)
            grids.append(grid)
    if pixels:
        assert torch.equal(batch.pixel_values, torch.cat(pixels))
        assert batch.image_grid_thw.tolist() == grids
    else:
        assert batch.pixel_values is None and batch.image_grid_thw is None
    assert batch.video_grid_thw is None and batch.pixel_values_videos is None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_batch_equals_its_tokenized_rows_and_original_media(images, num_workers):
    rows = tokenized_rows(images.tokenized)
    oracle = _image_oracle(images.processor)
    batches = _energon(
        images.path, PackedBatchTaskEncoder(str(images.processor), str(images.processor)), num_workers, 1
    )
    assert sorted(k for b in batches for k in b.pack_keys) == [
        f"pack-{i:08d}" for i in range(images.packed.manifest.packs.packs)
    ]
    assert sum(b.num_media for b in batches) > 10
    for batch in batches:
        assert isinstance(batch, PackedBatch) and len(batch.pack_keys) == 1
        _check_batch_against_tokenized(batch, rows, pad_id=-1, image_oracle=oracle)
        assert torch.equal(batch.cu_seqlens, batch.cu_seqlens_padded)


def test_padded_slots_hold_pad_tokens_without_loss(padded, encoder):
    rows = tokenized_rows(padded.tokenized)
    pad_id = encoder.pad_token_id
    packs = _packs(padded.path)
    oracle = _image_oracle(padded.processor)
    slack = 0
    for pack in packs:
        batch = encoder.encode(pack)
        assert all(x % 8 == 0 for x in batch.cu_seqlens_padded.tolist())
        _check_batch_against_tokenized(batch, rows, pad_id=pad_id, image_oracle=oracle)
        slack += batch.num_tokens - batch.num_real_tokens
        pos = batch.position_ids[1:, 0]
        for i in range(batch.num_samples):  # pads continue after the sample's largest rope position
            real_end, slot_end = (
                int(batch.cu_seqlens[i + 1] - batch.cu_seqlens[i] + batch.cu_seqlens_padded[i]),
                int(batch.cu_seqlens_padded[i + 1]),
            )
            if slot_end > real_end:
                top = int(pos[:, int(batch.cu_seqlens_padded[i]) : real_end].max())
                assert pos[:, real_end:slot_end].tolist() == [list(range(top + 1, top + 1 + slot_end - real_end))] * 3
    assert slack > 0


def test_grid_mismatch_names_pack_sample_member_and_grids(images, encoder):
    pack = next(p for p in _packs(images.path) if p.media)
    item = pack.media[0]
    t, h, w = item.meta.grid_thw
    bad = dataclasses.replace(item, meta=dataclasses.replace(item.meta, grid_thw=(t, h + 2, w)))
    altered = dataclasses.replace(pack, media=(bad, *pack.media[1:]))
    with pytest.raises(GridMismatchError) as err:
        encoder.encode(altered)
    message = str(err.value)
    for part in (pack.key, pack.sample_ids[item.meta.sample], item.meta.member, str((t, h + 2, w)), str((t, h, w))):
        assert part in message
    encoder.encode(pack)  # the unaltered pack encodes


@pytest.mark.parametrize("num_workers", [0, 2])
def test_other_processor_settings_stop_the_loader(images, tmp_path, num_workers):
    """A processor whose pixel limits differ from tokenize's: the loader fails, it never skips."""
    proc = tmp_path / "processor"
    shutil.copytree(images.processor, proc)
    config = json.loads((proc / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = config["max_pixels"] = 28 * 28 * 16
    (proc / "preprocessor_config.json").write_text(json.dumps(config))
    te = PackedBatchTaskEncoder(str(proc), str(images.processor))
    with pytest.raises(GridMismatchError, match="processor grid_thw"):  # as train.loader configures Energon
        _energon(images.path, te, num_workers, 1, reraise=True)
    if num_workers == 0:
        with pytest.raises(FatalSampleError, match="1 times in a row"):  # Energon's default handler: logs, stops
            _energon(images.path, te, num_workers, 1)


def test_video_without_torchvision_names_the_sample(packed_example, encoder):
    pytest.importorskip("av")
    try:
        import torchvision  # noqa: F401

        pytest.skip("torchvision present: the video processor runs")
    except ImportError:
        pass
    videos = packed_example(media="videos")
    pack = _packs(videos.path)[0]
    video = next(m for m in pack.media if m.meta.kind == "video")
    with pytest.raises(VideoPackageMissing) as err:  # a missing package: exit 3, with the install line
        encoder.encode(pack)
    assert pack.key in str(err.value) and pack.sample_ids[video.meta.sample] in str(err.value)
    assert "pip install torchvision" in str(err.value) and err.value.exit_code == ExitCode.RESOURCE
    with pytest.raises(VideoPackageMissing, match=pack.key):  # surfaces from the loader, not skipped
        _energon(videos.path, PackedBatchTaskEncoder(str(videos.processor), str(videos.processor)), 0, 1, reraise=True)


def test_video_frames_equal_pyav_decoding_every_frame(packed_example):
    videos = packed_example(media="videos")
    items = [m for row in tokenized_rows(videos.tokenized).values() for m in row["media"] if m["kind"] == "video"]
    seen = set()
    for item in items:
        if item["ref"] in seen:
            continue
        seen.add(item["ref"])
        with av.open(item["ref"]) as container:
            every = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        meta = video_meta(MediaRef(path=item["ref"]))
        origin = MediaOrigin(pack_key="p", sample_id="s", member="m")
        for indices in (item["frame_indices"], [0, len(every) - 1], list(range(len(every)))):
            got = decode_video_frames(Path(item["ref"]).read_bytes(), indices, origin)
            assert np.array_equal(got.frames, np.stack([every[i] for i in indices]))
            assert (got.total_frames, got.fps) == (meta.num_frames, meta.fps)
            assert got.sampled_fps == pytest.approx(len(indices) / meta.num_frames * meta.fps)
    assert len(seen) >= 3


class _Qwen2VideoGrids:
    """Stands in for Qwen2VLVideoProcessor (needs torchvision): its grid rule, zero pixels."""

    def __init__(self, video_config: dict) -> None:
        self.config, self.calls = video_config, []

    def __call__(self, videos, do_sample_frames, return_tensors):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        (frames,) = videos
        self.calls.append((frames, do_sample_frames))
        size = self.config["size"]
        hb, wb = smart_resize(frames.shape[1], frames.shape[2], 28, size["shortest_edge"], size["longest_edge"])
        grid = [-(-len(frames) // 2), hb // 14, wb // 14]
        return {
            "pixel_values_videos": torch.zeros(grid[0] * grid[1] * grid[2], 1176),
            "video_grid_thw": torch.tensor([grid]),
        }


def test_video_path_plumbing_with_a_stand_in_processor(packed_example, encoder):
    """Frames, grid check, second_per_grid_ts (= transformers' sampled_fps rule) and rope with videos."""
    from transformers.video_utils import VideoMetadata

    videos = packed_example(media="videos")
    config = json.loads((videos.processor / "video_preprocessor_config.json").read_text())
    stand_in = _Qwen2VideoGrids(config)
    layout = encoder.media.layout
    settings = dataclasses.replace(layout.settings, second_per_grid_ts=True)
    layout = dataclasses.replace(layout, video_processor=stand_in, settings=settings)
    video_encoder = dataclasses.replace(encoder, media=dataclasses.replace(encoder.media, layout=layout))
    rows = tokenized_rows(videos.tokenized)
    for pack in _packs(videos.path):
        batch = video_encoder.encode(pack)
        items = [m.meta for m in pack.media if m.meta.kind == "video"]
        assert batch.video_grid_thw.tolist() == [list(m.grid_thw) for m in items]
        assert batch.pixel_values_videos.shape[0] == int(batch.video_grid_thw.prod(-1).sum())
        want = []
        for item in items:
            ref = next(m["ref"] for m in rows[pack.sample_ids[item.sample]]["media"] if m["kind"] == "video")
            meta = video_meta(MediaRef(path=ref))
            sampled = VideoMetadata(
                total_num_frames=meta.num_frames, fps=meta.fps, frames_indices=list(item.frame_indices)
            )
            want.append(2 / sampled.sampled_fps)
        assert batch.vision["second_per_grid_ts"].tolist() == pytest.approx(want)
        assert batch.position_ids.shape == (4, 1, batch.num_tokens)
        assert (batch.mm_token_type_ids == 2).sum() == sum(t * h * w // 4 for t, h, w in batch.video_grid_thw.tolist())
    assert stand_in.calls and all(flag is False for _, flag in stand_in.calls)
    pack = _packs(videos.path)[0]
    item = next(m for m in pack.media if m.meta.kind == "video")
    grid = item.meta.grid_thw
    bad = dataclasses.replace(item, meta=dataclasses.replace(item.meta, grid_thw=(grid[0] + 1, *grid[1:])))
    with pytest.raises(GridMismatchError, match=item.meta.member):
        video_encoder.encode(dataclasses.replace(pack, media=tuple(bad if m is item else m for m in pack.media)))


def test_image_decoding_follows_load_image(example_dir):
    """EXIF-rotated, RGBA, grey, CMYK, palette: bytes decode as transformers decodes a path."""
    media = example_dir / "media"
    files = [p for p in sorted(media.glob("*.*")) if "corrupt" not in p.name and p.suffix in (".jpg", ".png")]
    assert any("exif" in p.name for p in files) and any("rgba" in p.name for p in files)
    origin = MediaOrigin(pack_key="p", sample_id="s", member="m")
    for path in files:
        ours = decode_image(path.read_bytes(), origin)
        theirs = load_image(str(path))
        assert ours.mode == "RGB" and ours.size == theirs.size
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), path.name


# --- rope: per sample, the family's own get_rope_index on a real tiny model -------------------

IMAGE_ID, VIDEO_ID, START_ID, END_ID = 3001, 3002, 3003, 3004


def _tiny_config(family: str):
    return AutoConfig.for_model(
        family,
        text_config=dict(
            vocab_size=3100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, embed_dim=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
        ),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID, vision_end_token_id=END_ID,
    )  # fmt: skip


def _vision(token: int, grid: tuple[int, int, int], per_frame_text: bool) -> list[int]:
    t, h, w = grid
    block = [token] * (h * w // 4)
    if per_frame_text:  # Qwen3-VL: "<t seconds>" text + start + frame + end per temporal step
        return [x for k in range(t) for x in [7, 8 + k, START_ID, *block, END_ID]]
    return [START_ID, *block * t, END_ID]


def _media(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if v is not None}


def _samples(family: str) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    qwen3 = family in ("qwen3_vl", "qwen3_5")
    video = (2, 4, 6)
    return [
        ([1, 2, *_vision(IMAGE_ID, (1, 4, 6), False), 3, 4, 5], _media(image_grid_thw=torch.tensor([[1, 4, 6]]))),
        (list(range(10, 17)), _media()),
        (
            [9, *_vision(IMAGE_ID, (1, 6, 4), False), 9, *_vision(VIDEO_ID, video, qwen3), 11, 12],
            _media(
                image_grid_thw=torch.tensor([[1, 6, 4]]),
                video_grid_thw=torch.tensor([video]),
                second_per_grid_ts=torch.tensor([0.5]) if family == "qwen2_5_vl" else None,
            ),
        ),
    ]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_rope_rows_equal_get_rope_index_of_each_sample_alone(family):
    config = _tiny_config(family)
    model = MODEL_MAPPING[type(config)](config)  # real, randomly initialised, on CPU
    samples = _samples(family)
    lengths = [len(ids) for ids, _ in samples]
    slots = [n + (-n) % 8 for n in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    cp = np.concatenate([[0], np.cumsum(slots)]).tolist()
    row = torch.zeros(cp[-1], dtype=torch.int64)
    for (ids, _), start in zip(samples, cp):
        row[start : start + len(ids)] = torch.tensor(ids)
    rope = RopeIndex.from_config(config, mrope=True, mm_token_ids={1: IMAGE_ID, 2: VIDEO_ID})
    positions = rope.positions(row, cu, cp, [m for _, m in samples])
    assert positions.shape == (4, 1, cp[-1])
    for (ids, media), start, slot in zip(samples, cp, slots):
        ids_t = torch.tensor([ids])
        types = (ids_t == IMAGE_ID).long() + 2 * (ids_t == VIDEO_ID).long()
        alone, _ = model.get_rope_index(
            ids_t, mm_token_type_ids=types, image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"), second_per_grid_ts=media.get("second_per_grid_ts"),
        )  # fmt: skip
        assert torch.equal(positions[1:, 0, start : start + len(ids)], alone[:, 0])
        assert positions[0, 0, start : start + slot].tolist() == list(range(slot))
        top = int(alone.max())
        assert (
            positions[1:, 0, start + len(ids) : start + slot].tolist()
            == [list(range(top + 1, top + 1 + slot - len(ids)))] * 3
        )
    # whole-row numbering differs from per-sample numbering: the check above is not vacuous
    whole, _ = model.get_rope_index(
        torch.cat([torch.tensor(ids) for ids, _ in samples])[None],
        mm_token_type_ids=rope.mm_token_type_ids(torch.cat([torch.tensor(ids) for ids, _ in samples]))[None],
        image_grid_thw=torch.cat([m["image_grid_thw"] for _, m in samples if "image_grid_thw" in m]),
        video_grid_thw=samples[2][1]["video_grid_thw"],
        second_per_grid_ts=samples[2][1].get("second_per_grid_ts"),
    )
    assert not torch.equal(whole[:, 0, cu[1] : cu[2]], positions[1:, 0, cp[1] : cp[1] + lengths[1]])


def test_example_packs_rope_equals_a_real_tiny_model_per_sample(images, encoder):
    """Real packs: the encoder (meta-built from the processor's config.json) vs a real tiny model."""
    ids_cfg = json.loads((images.processor / "config.json").read_text())
    config = AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2),
        image_token_id=ids_cfg["image_token_id"], video_token_id=ids_cfg["video_token_id"],
    )  # fmt: skip
    model = MODEL_MAPPING[type(config)](config)
    checked = 0
    for pack in _packs(images.path)[:4]:
        batch = encoder.encode(pack)
        grids = iter(batch.image_grid_thw)
        for i in range(batch.num_samples):
            start, n = int(batch.cu_seqlens_padded[i]), int(batch.cu_seqlens[i + 1] - batch.cu_seqlens[i])
            ids = batch.input_ids[:, start : start + n]
            count = sum(1 for m in pack.media if m.meta.sample == i)
            mine = [next(grids) for _ in range(count)]
            alone, _ = model.get_rope_index(
                ids, mm_token_type_ids=(ids == config.image_token_id).long(),
                image_grid_thw=torch.stack(mine) if mine else None,
            )  # fmt: skip
            assert torch.equal(batch.position_ids[1:, :, start : start + n], alone)
            checked += count
    assert checked >= 4


def test_text_only_config_gives_one_restarting_row():
    config = AutoConfig.for_model("qwen2", vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    rope = RopeIndex.from_config(config, mrope=False, mm_token_ids={})
    positions = rope.positions(torch.arange(10), [0, 3, 7], [0, 4, 10], [{}, {}])
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]


# --- concat_batches, hand-computed ------------------------------------------------------------


def _batch(n_slots: list[tuple[int, int]], key: str, grids: list[list[int]] | None, start_id: int) -> PackedBatch:
    real = [r for r, _ in n_slots]
    slot = [s for _, s in n_slots]
    total = sum(slot)
    ids = torch.arange(start_id, start_id + total)[None]
    return PackedBatch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=torch.zeros(4, 1, total, dtype=torch.int64),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(real)]), dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(np.concatenate([[0], np.cumsum(slot)]), dtype=torch.int32),
        max_seqlen=max(slot),
        mm_token_type_ids=torch.zeros(1, total, dtype=torch.int64),
        vision={
            "pixel_values": torch.full((sum(t * h * w for t, h, w in grids), 2), float(start_id)),
            "image_grid_thw": torch.tensor(grids),
        }
        if grids
        else {},
        pack_keys=(key,),
        sample_ids=tuple(f"{key}:{i}" for i in range(len(real))),
    )


def test_concat_batches_hand_computed():
    a = _batch([(3, 4), (2, 4)], "a", [[1, 2, 2]], 0)  # cu [0 3 5], padded [0 4 8]
    b = _batch([(3, 3)], "b", None, 100)  # cu [0 3], padded [0 3]
    c = _batch([(5, 8), (1, 8)], "c", [[1, 2, 4], [1, 2, 2]], 200)  # cu [0 5 6], padded [0 8 16]
    got = concat_batches([a, b, c], GridLayout.joins)
    assert got.cu_seqlens.tolist() == [0, 3, 5, 8, 13, 14] and got.cu_seqlens.dtype == torch.int32
    assert got.cu_seqlens_padded.tolist() == [0, 4, 8, 11, 19, 27] and got.cu_seqlens_padded.dtype == torch.int32
    assert got.max_seqlen == 8 and got.num_tokens == 27 and got.num_real_tokens == 14
    assert got.input_ids.tolist() == [list(range(8)) + list(range(100, 103)) + list(range(200, 216))]
    assert got.position_ids.shape == (4, 1, 27)
    assert got.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    assert got.pixel_values[:, 0].tolist() == [0.0] * 4 + [200.0] * 12
    assert got.pack_keys == ("a", "b", "c") and got.sample_ids == ("a:0", "a:1", "b:0", "c:0", "c:1")
    assert got.video_grid_thw is None and set(got.vision) == {"pixel_values", "image_grid_thw"}
    assert concat_batches([a], GridLayout.joins) is a
    with pytest.raises(ValueError):
        concat_batches([], GridLayout.joins)
    with pytest.raises(ValueError, match="no join rule"):
        concat_batches([a, c], {})


def test_task_encoder_hooks_are_stateless_and_pickle_without_processors(images):
    te = PackedBatchTaskEncoder(str(images.processor), str(images.processor))
    assert all(get_stateless(f) for f in (te.encode_sample, te.batch, te.encode_batch))
    assert te.encoder is te.encoder  # built once, lazily
    clone = pickle.loads(pickle.dumps(te))
    assert clone._encoder is None and clone.processor == te.processor
    assert len(pickle.dumps(te)) < 10_000
