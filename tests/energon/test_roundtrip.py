"""tokenize -> pack -> energon-index -> Energon's own loader, on CPU.

Truths: Energon's `get_train_dataset`/`get_loader` (no code of ours but the cooker), the
tokenized parts read with pyarrow, the original media files and LMDB values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from megatron.energon import WorkerConfig, get_loader, get_train_dataset

from prep.cli import main
from prep.energon.blend import parse_blend, write_blend
from prep.energon.cooker import PACK_COOKER, PackDecodeError, PackedSample, PackedTaskEncoder, cook_pack
from prep.energon.index import EnergonIndexError, index_dataset, verify_dataset
from tests.shards.oracles import check_pack_against_tokenized, pack, read_packed, tokenized_dir, tokenized_rows


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def dataset(tok: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("energon") / "packed"
    manifest = pack([tok], out, shard_size="3packs")
    index_dataset(out)
    return out, manifest


def _load(path: Path, num_workers: int, split: str = "train") -> list[PackedSample]:
    ds = get_train_dataset(
        path,
        split_part=split,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=num_workers),
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=PackedTaskEncoder(),
    )
    return list(get_loader(ds))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_energon_returns_every_pack_once_with_its_tokens_and_media(dataset, tok, num_workers):
    out, manifest = dataset
    samples = _load(out, num_workers)
    keys = [s.__key__ for s in samples]
    assert sorted(keys) == [f"pack-{i:08d}" for i in range(manifest["packs"]["packs"])]
    rows = tokenized_rows(tok)
    on_disk = read_packed(out)
    for s in samples:
        assert isinstance(s, PackedSample)
        import json

        meta = json.loads(on_disk[s.__key__]["json"])
        media = {m.member: m.data for m in s.media}
        check_pack_against_tokenized(meta, s.input_ids, s.loss_mask, media, [rows])
        assert s.sample_ids == [x["sample_id"] for x in meta["samples"]]
        assert s.cu_seqlens.dtype == np.int32 and s.cu_seqlens[-1] == s.input_ids.size <= s.pack_size
        assert [m.grid_thw for m in s.media] == [tuple(m["grid_thw"]) for m in meta["media"]]
        assert s.__subflavors__["format"] == "packvlm.packed"


def test_index_writes_energons_files(dataset):
    out, manifest = dataset
    meta = out / ".nv-meta"
    for name in ("split.yaml", ".info.json", "index.sqlite", "dataset.yaml"):
        assert (meta / name).is_file(), name
    assert all(Path(f"{out / s['name']}.idx").is_file() for s in manifest["shards"])
    definition = yaml.safe_load((meta / "dataset.yaml").read_text())
    assert definition["__class__"] == "CrudeWebdataset" and definition["__module__"] == "megatron.energon"
    assert verify_dataset(out) == {"train": manifest["packs"]["packs"]}


def test_split_ratio_and_patterns_via_cli(dataset, tmp_path):
    out, manifest = dataset
    runner = CliRunner()
    result = runner.invoke(main, ["energon-index", str(out), "--split-ratio", "0.5,0.5,0", "--verify"])
    assert result.exit_code == 0, result.output
    assert "each exactly once" in result.output
    split = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert split["train"] and split["val"]
    train, val = len(_load(out, 0, "train")), len(_load(out, 0, "val"))
    assert train + val == manifest["packs"]["packs"] and train and val
    result = runner.invoke(
        main,
        [
            "energon-index",
            str(out),
            "--split-pattern",
            "val:shards/shard-000000.tar",
            "--split-pattern",
            r"train:shards/shard-0*[1-9]\d*.tar",
            "--verify",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(_load(out, 0, "val")) == manifest["shards"][0]["packs"]
    runner.invoke(main, ["energon-index", str(out)])  # back to all-train for other tests
    bad = runner.invoke(main, ["energon-index", str(tmp_path)])
    assert bad.exit_code == 2 and "manifest.json" in bad.output


def test_blend_yaml_loads_with_energon(dataset, tok, tmp_path):
    out, _ = dataset
    other = tmp_path / "big"
    pack([tok], other, pack_size=2048, shard_size="4packs")
    index_dataset(other)
    blend_file = tmp_path / "blend.yaml"
    result = CliRunner().invoke(
        main, ["energon-blend", "--blend", f"{out}=3", "--blend", f"{other}=1", "--output", str(blend_file)]
    )
    assert result.exit_code == 0, result.output
    definition = yaml.safe_load(blend_file.read_text())
    assert definition["__class__"] == "MetadatasetV2"
    assert [b["weight"] for b in definition["splits"]["train"]["blend"]] == [3.0, 1.0]
    ds = get_train_dataset(
        blend_file,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=PackedTaskEncoder(),
    )
    sizes = []
    for i, sample in enumerate(get_loader(ds)):
        sizes.append(sample.pack_size)
        if i == 199:
            break
    assert set(sizes) == {1024, 2048}
    assert 0.6 < sizes.count(1024) / len(sizes) < 0.9
    with pytest.raises(EnergonIndexError):
        write_blend([parse_blend(f"{tmp_path}=1")], tmp_path / "x.yaml")
    with pytest.raises(EnergonIndexError):
        parse_blend("./a=zero")


def test_checkpointed_loader_resumes_on_the_same_packs(dataset):
    from megatron.energon import get_savable_loader

    out, _ = dataset

    def loader():
        ds = get_train_dataset(
            out,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            batch_size=None,
            shuffle_buffer_size=4,
            max_samples_per_sequence=2,
            task_encoder=PackedTaskEncoder(),
        )
        return get_savable_loader(ds)

    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.save_state_rank()
    expected = [next(it).__key__ for _ in range(6)]
    restored = loader()
    restored.restore_state_rank(state)
    it = iter(restored)
    assert [next(it).__key__ for _ in range(6)] == expected


def test_cooker_is_stateless_and_refuses_decoded_media(dataset):
    from megatron.energon.task_encoder.base import get_stateless

    out, _ = dataset
    assert get_stateless(cook_pack) and PACK_COOKER.is_match({"format": "packvlm.packed", "pack_size": 1})
    members = next(iter(read_packed(out).values()))
    crude = {"__key__": "pack-x", "__restore_key__": (), **members}
    assert cook_pack(crude).input_ids.size > 0
    media = next(k for k in members if k.startswith(("img", "vid")))
    with pytest.raises(PackDecodeError, match="decoder = None"):
        cook_pack({**crude, media: np.zeros((2, 2, 3))})
    with pytest.raises(PackDecodeError, match="missing"):
        cook_pack({k: v for k, v in crude.items() if k != "input_ids.npy"})
