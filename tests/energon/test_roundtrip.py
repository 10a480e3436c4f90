"""tokenize -> pack -> energon-index -> Energon's own loader, on CPU.

Truths: Energon's `get_train_dataset`/`get_loader` (no code of ours but the cooker), the
members read from the tars directly, the tokenized parts read with pyarrow, the original
media files and LMDB values.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from megatron.energon import WorkerConfig, get_loader, get_train_dataset

from packvlm.energon import PACK_COOKER, PackDecodeError, PackedSample, PackedTaskEncoder, cook_pack
from prep.cli import main
from prep.energon.blend import parse_blend, write_blend
from prep.energon.index import index_dataset, verify_dataset
from schemas.energon import EnergonIndexError
from schemas.packed import PACKED_SCHEMA_VERSION, PackedOutput, read_packed_output
from tests.shards.oracles import check_pack_against_tokenized, pack, read_packed, tokenized_dir, tokenized_rows


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def dataset(tok: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PackedOutput]:
    out = tmp_path_factory.mktemp("energon") / "packed"
    pack([tok], out, shard_size="3packs")
    index_dataset(out)
    return out, read_packed_output(out)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


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
    out, packed = dataset
    samples = _load(out, num_workers)
    keys = [s.__key__ for s in samples]
    assert sorted(keys) == [f"pack-{i:08d}" for i in range(packed.manifest.packs.packs)]
    rows = tokenized_rows(tok)
    on_disk = read_packed(out)
    for s in samples:
        assert isinstance(s, PackedSample)
        p = s.pack
        meta = json.loads(on_disk[s.__key__]["json"])
        assert p.key == s.__key__ == meta["key"]
        media = {m.meta.member: m.data for m in p.media}
        check_pack_against_tokenized(meta, p.input_ids, p.loss_mask, media, [rows])
        assert list(p.sample_ids) == [x["sample_id"] for x in meta["samples"]]
        assert p.input_ids.dtype == p.cu_seqlens.dtype == np.int32 and p.loss_mask.dtype == np.uint8
        assert p.cu_seqlens.tolist() == meta["cu_seqlens"] and p.cu_seqlens_padded.tolist() == meta["cu_seqlens_padded"]
        assert p.cu_seqlens[-1] == p.input_ids.size and p.cu_seqlens_padded[-1] <= packed.manifest.pack_size == 1024
        assert "pack_size" not in meta  # one copy: the manifest's
        assert [m.meta.grid_thw for m in p.media] == [tuple(m["grid_thw"]) for m in meta["media"]]
        assert [m.meta.ref for m in p.media] == [m["ref"] for m in meta["media"]]
        assert s.__subflavors__["format"] == "packvlm.packed"


def test_index_writes_energons_files(dataset):
    out, packed = dataset
    meta = out / ".nv-meta"
    for name in ("split.yaml", ".info.json", "index.sqlite", "dataset.yaml"):
        assert (meta / name).is_file(), name
    assert all(Path(f"{path}.idx").is_file() for path in packed.shard_paths)
    definition = yaml.safe_load((meta / "dataset.yaml").read_text())
    assert definition["__class__"] == "CrudeWebdataset" and definition["__module__"] == "megatron.energon"
    assert definition["subflavors"] == {"format": "packvlm.packed", "format_version": PACKED_SCHEMA_VERSION}
    assert verify_dataset(out) == {"train": packed.manifest.packs.packs}
    assert not list(meta.glob(".tmp-*"))


def test_split_ratio_and_patterns_via_cli(dataset, tmp_path):
    out, packed = dataset
    runner = CliRunner()
    result = runner.invoke(main, ["energon-index", str(out), "--split-ratio", "0.5,0.5,0", "--verify"])
    assert result.exit_code == 0, result.output
    assert "each exactly once" in result.output
    split = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert split["train"] and split["val"]
    train, val = len(_load(out, 0, "train")), len(_load(out, 0, "val"))
    assert train + val == packed.manifest.packs.packs and train and val
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
    assert len(_load(out, 0, "val")) == packed.shards.shards[0].packs
    runner.invoke(main, ["energon-index", str(out)])  # back to all-train for other tests
    bad = runner.invoke(main, ["energon-index", str(tmp_path)])
    assert bad.exit_code == 2 and "manifest.json" in bad.output


def test_index_refuses_an_unfinished_packed_directory(dataset, tmp_path):
    out, _ = dataset
    copy = tmp_path / "packed"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".nv-meta", "*.idx"))
    (copy / "shards.json").unlink()
    result = CliRunner().invoke(main, ["energon-index", str(copy)])
    assert result.exit_code == 2 and "no shards.json" in result.output and "prep shards" in result.output
    assert not (copy / ".nv-meta").exists()


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
    origins = []  # the dataset each pack came from, as Energon's provenance names it
    for i, sample in enumerate(get_loader(ds)):
        origins.append(Path(str(sample.__sources__[0].dataset_path)).resolve())
        if i == 199:
            break
    assert set(origins) == {out.resolve(), other.resolve()}
    assert 0.6 < origins.count(out.resolve()) / len(origins) < 0.9
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
    assert get_stateless(cook_pack) and PACK_COOKER.is_match(
        {"format": "packvlm.packed", "format_version": 2, "pack_size": 1}
    )
    key, members = next(iter(read_packed(out).items()))
    crude = {"__key__": key, "__restore_key__": (), **members}
    assert cook_pack(crude).pack.input_ids.size > 0
    media = next(k for k in members if k.startswith(("img", "vid")))
    with pytest.raises(PackDecodeError, match="decoder = None"):
        cook_pack({**crude, media: np.zeros((2, 2, 3))})
    with pytest.raises(PackDecodeError, match="missing"):
        cook_pack({k: v for k, v in crude.items() if k != "input_ids.npy"})
    with pytest.raises(PackDecodeError, match="belongs to pack"):
        cook_pack({**crude, "__key__": "pack-99999999"})
    with pytest.raises(PackDecodeError, match="json says"):
        cook_pack({**crude, "loss_mask.npy": _npy(np.zeros(1, np.uint8))})


def test_verify_prints_no_pin_memory_warning_on_cpu(dataset):
    """Energon's loader asks torch to pin memory; without a GPU torch warned on every run (issue 20)."""
    import warnings

    out, packed = dataset
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert verify_dataset(out) == {"train": packed.manifest.packs.packs}
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]
