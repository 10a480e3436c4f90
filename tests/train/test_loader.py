"""make_loader over real packed example data; open_packed_dataset failure modes.

Truths: the pack manifest (every pack key), Energon's own loader run separately (one pack per
batch) for concatenation, an uninterrupted loader for resume, hand-broken copies of a dataset.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from families.qwen2_vl.layout import GridLayout
from schemas.manifest import PackManifest
from schemas.packed import PACKED_SCHEMA_VERSION
from train.batch import PackedBatch, concat_batches
from train.dataset import TrainConfigError, open_packed_dataset
from train.loader import LoaderConfig, loader_state, make_loader, restore_loader
from train.pixels import PackedPixels


@pytest.fixture(scope="module")
def images(packed_example):
    return packed_example(media="images")


def _config(images, **kw) -> LoaderConfig:
    base = dict(data=str(images.path), processor=str(images.processor), model=str(images.processor), num_workers=0)
    return LoaderConfig(**{**base, **kw})


def _all_keys(images) -> list[str]:
    return [f"pack-{i:08d}" for i in range(images.packed.manifest.packs.packs)]


def _take(loader, n: int) -> list[PackedBatch]:
    return list(itertools.islice(iter(loader), n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_read_disjoint_packs_covering_the_dataset(images, num_workers):
    seen = []
    for rank in (0, 1):
        config = _config(images, rank=rank, world_size=2, num_workers=num_workers, repeat=False)
        seen.append([k for batch in make_loader(config) for k in batch.pack_keys])
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == _all_keys(images)


def test_packs_per_microbatch_concatenates_the_packs(images):
    config = _config(images, repeat=False, shuffle_buffer_size=None)
    single = {b.pack_keys[0]: b for b in make_loader(config)}
    pairs = list(make_loader(dataclasses.replace(config, packs_per_microbatch=2)))
    assert [len(b.pack_keys) for b in pairs] == [2] * (len(single) // 2) + [1] * (len(single) % 2)
    assert sorted(k for b in pairs for k in b.pack_keys) == sorted(single) == _all_keys(images)
    for batch in pairs:
        parts = [single[k] for k in batch.pack_keys]
        assert batch.cu_seqlens_padded[-1] == batch.num_tokens == sum(p.num_tokens for p in parts)
        assert batch.num_samples == len(batch.sample_ids) == sum(p.num_samples for p in parts)
        expected = concat_batches(parts, GridLayout.joins)
        for field in dataclasses.fields(PackedBatch):
            a, b = getattr(batch, field.name), getattr(expected, field.name)
            if field.name == "vision":
                a, b = batch.vision_inputs(), expected.vision_inputs()
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            else:
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name


def test_uint8_pixels_through_workers_equal_the_processors_floats(images):
    """Two workers ship 8-bit pixels through shared memory; made float in this process they equal,
    bit for bit, what a loader shipping the processor's float32 output delivers - at a quarter of the bytes."""
    config = _config(images, num_workers=2, repeat=False, shuffle_buffer_size=None)
    floats = {b.pack_keys: b for b in make_loader(dataclasses.replace(config, pixels="float32"))}
    raw = {b.pack_keys: b for b in make_loader(config)}
    assert raw.keys() == floats.keys() and any(b.num_media for b in raw.values())
    for keys, batch in raw.items():
        want = floats[keys]
        got = batch.vision_inputs()
        assert got.keys() == want.vision.keys() and all(torch.equal(got[k], want.vision[k]) for k in got), keys
        if batch.num_media:
            assert isinstance(batch.vision["pixel_values"], PackedPixels)
            assert batch.vision["pixel_values"].values.nbytes * 4 == want.vision["pixel_values"].nbytes


@pytest.mark.parametrize(("num_workers", "sampling"), [(0, "epoch"), (2, "epoch"), (2, "buffer")])
def test_restored_loader_continues_with_the_same_batches(images, num_workers, sampling):
    config = _config(
        images,
        num_workers=num_workers,
        packs_per_microbatch=2,
        shuffle_buffer_size=4,
        max_samples_per_sequence=2,
        sampling=sampling,
    )
    first = make_loader(config)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = loader_state(first)
    assert isinstance(state, bytes)
    expected = [next(it) for _ in range(5)]  # crosses the end of the 9-pack epoch
    resumed = _take(restore_loader(config, state), 5)
    assert [b.pack_keys for b in resumed] == [b.pack_keys for b in expected]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(resumed, expected))
    for a, b in zip(resumed, expected):
        assert (a.pixel_values is None and b.pixel_values is None) or torch.equal(a.pixel_values, b.pixel_values)


@pytest.mark.parametrize("sampling", ["epoch", "buffer"])
def test_the_seed_decides_the_order(images, sampling):
    def keys(seed: int) -> list[tuple[str, ...]]:
        config = _config(images, seed=seed, shuffle_buffer_size=4, max_samples_per_sequence=2, sampling=sampling)
        return [b.pack_keys for b in _take(make_loader(config), 4)]

    assert keys(0) == keys(0)
    assert keys(0) != keys(1)


def test_epoch_order_is_the_same_stream_on_any_number_of_ranks(images):
    """Rank r of W takes every W-th pack of the one-rank stream; a position saved on 2 ranks
    continues on 3 with the one-rank stream's next packs (no pack twice, none skipped)."""
    one = [k for b in make_loader(_config(images, repeat=False)) for k in b.pack_keys]
    assert sorted(one) == _all_keys(images)
    two = [make_loader(_config(images, rank=r, world_size=2)) for r in range(2)]
    iters = [iter(loader) for loader in two]
    steps = [[next(it).pack_keys[0] for it in iters] for _ in range(2)]
    assert [k for step in steps for k in step] == one[:4]
    state = loader_state(two[0])
    assert state == loader_state(two[1])  # one global position, whichever rank reports it
    three = [iter(make_loader(_config(images, rank=r, world_size=3), state=state)) for r in range(3)]
    assert [next(it).pack_keys[0] for it in three] == one[4:7]


# --- open_packed_dataset / validation: each failure names its fix ------------------------------


@pytest.fixture
def copy(images, tmp_path) -> Path:
    out = tmp_path / "packed"
    shutil.copytree(images.path, out)
    return out


def test_both_recipes_take_the_loaders_defaults():
    """The loader flags are declared once, on LoaderConfig: `train hf` and `train megatron` default to its values
    (`train megatron` has the two Bridge's Energon loader takes from us; the seed there is the recipe's)."""
    from packvlm.cli import default_of
    from train.recipes.hf import HFTrainConfig
    from train.recipes.megatron import MegatronTrainConfig

    names = ("num_workers", "packs_per_microbatch", "seed", "sampling", "pixels", "shuffle_buffer_size")
    loader = {name: default_of(LoaderConfig, name) for name in names}
    assert {name: default_of(HFTrainConfig, name) for name in names} == loader
    shared = ("num_workers", "packs_per_microbatch")
    assert {name: default_of(MegatronTrainConfig, name) for name in shared} == {name: loader[name] for name in shared}


def test_valid_dataset_info(images):
    info = open_packed_dataset(images.path, str(images.processor))
    assert info.num_packs == images.packed.manifest.packs.packs and info.pack_size == 1024
    assert info.processor_class == "Qwen2VLProcessor" and info.pad_to_multiple_of == 1
    assert info.num_shards == len(images.packed.shards.shards)


def test_missing_path_and_manifest(tmp_path):
    with pytest.raises(TrainConfigError, match="does not exist"):
        open_packed_dataset(tmp_path / "nope")
    with pytest.raises(TrainConfigError, match="not a `prep pack` output"):
        open_packed_dataset(tmp_path)


def test_not_indexed(copy):
    shutil.rmtree(copy / ".nv-meta")
    with pytest.raises(TrainConfigError, match=r"prep energon-index"):
        open_packed_dataset(copy)


def test_missing_index_file(copy):
    next((copy / "shards").glob("*.tar.idx")).unlink()
    with pytest.raises(TrainConfigError, match=r"\.tar\.idx.*prep energon-index"):
        open_packed_dataset(copy)


def test_missing_shard(copy):
    (copy / "shards" / "shard-000001.tar").unlink()
    with pytest.raises(TrainConfigError, match=r"shard-000001.tar.*run `prep shards"):
        open_packed_dataset(copy)


def test_pack_manifest_of_another_version(copy):
    path = copy / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 1}))
    expected = rf"pack manifest version 1, this packvlm reads version {PackManifest.VERSION}.*prep pack"
    with pytest.raises(TrainConfigError, match=expected):
        open_packed_dataset(copy)


def test_tokenized_directory_given_as_data(images):
    with pytest.raises(TrainConfigError, match=r"written by `prep tokenize`.*point --data at a `prep pack` output"):
        open_packed_dataset(images.tokenized)


def test_shards_written_from_another_plan(copy):
    path = copy / "shards.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "plan_sha256": "0" * 64}))
    with pytest.raises(TrainConfigError, match=r"another plan.*run `prep shards"):
        open_packed_dataset(copy)


def test_wrong_format_version(copy):
    path = copy / ".nv-meta" / "dataset.yaml"
    definition = yaml.safe_load(path.read_text())
    definition["subflavors"]["format_version"] = PACKED_SCHEMA_VERSION + 1
    path.write_text(yaml.dump(definition))
    with pytest.raises(TrainConfigError, match=f"format version {PACKED_SCHEMA_VERSION + 1}.*re-run `prep pack`"):
        open_packed_dataset(copy)
    definition["subflavors"]["format"] = "something.else"
    path.write_text(yaml.dump(definition))
    with pytest.raises(TrainConfigError, match="not a packvlm pack dataset"):
        open_packed_dataset(copy)


def test_wrong_pack_json_version(copy):
    import io
    import json
    import tarfile

    shard = copy / "shards" / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(shard, "w") as tar:
        for info, data in members:
            if info.name.endswith(".json"):
                data = json.dumps({**json.loads(data), "version": 99}).encode()
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(TrainConfigError, match="pack json version 99"):
        open_packed_dataset(copy)


def _as_written_by_version_2(root: Path) -> None:
    """Rewrite a packed, indexed directory as packvlm wrote it before pack_size was stored once: every pack
    json version 2 with its ``pack_size``, manifest version 3 with ``packs.pack_size``, dataset.yaml
    subflavors ``format_version: 2`` with ``pack_size``."""
    import io
    import tarfile

    from prep.energon.index import index_dataset
    from schemas.manifest import file_sha256

    manifest = json.loads((root / "manifest.json").read_text())
    pack_size = manifest["pack_size"]
    shards = json.loads((root / "shards.json").read_text())
    for record in shards["shards"]:
        path = root / record["name"]
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar]
        with tarfile.open(path, "w") as tar:
            for info, data in members:
                if info.name.endswith(".json"):
                    raw = json.loads(data)
                    data = json.dumps({**raw, "version": 2, "pack_size": pack_size}).encode()
                    info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        record["bytes"], record["sha256"] = path.stat().st_size, file_sha256(path)
    (root / "shards.json").write_text(json.dumps(shards))
    index_dataset(root)  # the members moved: Energon's offsets anew
    manifest["schema_version"] = 3
    manifest["packs"]["pack_size"] = pack_size
    (root / "manifest.json").write_text(json.dumps(manifest))
    definition = yaml.safe_load((root / ".nv-meta" / "dataset.yaml").read_text())
    definition["subflavors"] = {"format": "packvlm.packed", "format_version": 2, "pack_size": pack_size}
    (root / ".nv-meta" / "dataset.yaml").write_text(yaml.dump(definition, sort_keys=False))


def test_data_written_by_version_2_still_trains(images, copy):
    """Pack json v2, dataset.yaml format_version 2 and pack manifest v3 (each with its pack_size copy) read as
    before: the same dataset info and the same micro-batches as the current format."""
    _as_written_by_version_2(copy)
    with tarfile.open(copy / "shards" / "shard-000000.tar") as tar:  # the rewrite took
        first = json.load(tar.extractfile(next(m for m in tar if m.name.endswith(".json"))))
    assert first["version"] == 2 and first["pack_size"] == 1024
    assert open_packed_dataset(copy, str(images.processor)) == dataclasses.replace(
        open_packed_dataset(images.path, str(images.processor)), path=copy.resolve()
    )
    old, new = _take(make_loader(_config(images, data=str(copy))), 3), _take(make_loader(_config(images)), 3)
    assert [b.pack_keys for b in old] == [b.pack_keys for b in new]
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) for a, b in zip(old, new))
    assert all(torch.equal(a.cu_seqlens, b.cu_seqlens) for a, b in zip(old, new))


def test_pack_manifest_whose_pack_size_copies_disagree(copy):
    """The copies a manifest still holds are read and checked, not trusted one at a time."""
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "config": {**manifest["config"], "pack_size": 2048}}))
    with pytest.raises(TrainConfigError, match=r"config.pack_size 2048 differs from pack_size 1024.*prep pack"):
        open_packed_dataset(copy)
    old = {**manifest, "schema_version": 3, "packs": {**manifest["packs"], "pack_size": 4096}}
    (copy / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(TrainConfigError, match=r"packs.pack_size 4096 differs from pack_size 1024"):
        open_packed_dataset(copy)


def test_processor_of_another_class(images, processor_dirs):
    with pytest.raises(TrainConfigError, match="Qwen3VLProcessor.*tokenized with a Qwen2VLProcessor"):
        open_packed_dataset(images.path, str(processor_dirs["qwen3_vl"]))
    with pytest.raises(TrainConfigError, match="Qwen3VLProcessor"):
        make_loader(_config(images, processor=str(processor_dirs["qwen3_vl"])))


def test_processor_class_comes_from_the_pack_manifest_alone(images, processor_dirs, tmp_path):
    """The check holds after the tokenized inputs are moved away: `prep pack` recorded the processor."""
    copy = tmp_path / "packed"
    shutil.copytree(images.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for item in manifest["inputs"]:
        item["path"] = str(tmp_path / "moved-away")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert open_packed_dataset(copy).processor_class == "Qwen2VLProcessor"
    with pytest.raises(TrainConfigError, match="tokenized with a Qwen2VLProcessor"):
        open_packed_dataset(copy, str(processor_dirs["qwen3_vl"]))


def test_more_workers_than_packs(images):
    num_packs = images.packed.manifest.packs.packs
    with pytest.raises(TrainConfigError, match=f"holds {num_packs} packs but {2 * num_packs} data-parallel workers"):
        make_loader(_config(images, world_size=num_packs, num_workers=2))
    with pytest.raises(TrainConfigError, match="rank 2"):
        make_loader(_config(images, rank=2, world_size=2))


def test_loading_on_cpu_prints_no_pin_memory_warning(images):
    """Energon always asks torch to pin memory; on CPU torch warned at every loader start (issue 20)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(_take(make_loader(_config(images, num_workers=1)), 1)) == 1
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]


def test_an_uneven_split_over_workers_is_named(images, caplog):
    """Buffer sampling favours the longer worker ranges when ranks x workers do not divide the pack
    count: say so. Epoch sampling reads one global order, exact at any count: nothing to say."""
    from train.loader import validate_loader_config

    num_packs = images.packed.manifest.packs.packs
    uneven = next(w for w in range(2, num_packs + 1) if num_packs % w)
    with caplog.at_level("INFO", logger="train.loader"):
        validate_loader_config(_config(images, num_workers=1, sampling="buffer"))
        validate_loader_config(_config(images, num_workers=uneven, sampling="epoch"))
        assert not caplog.records
        validate_loader_config(_config(images, num_workers=uneven, sampling="buffer"))
    (record,) = caplog.records
    assert record.levelname == "INFO"  # a fact about the epoch, not a fault to fix
    assert f"{num_packs} packs over {uneven} data-parallel workers" in record.getMessage()
