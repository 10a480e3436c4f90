"""Splits in `prep energon-index`: the split `prep pack` recorded, or a --split-ratio met at
shard boundaries or refused.

Truths: Energon's own loaders (`get_train_dataset` / `get_val_dataset`), the pack keys in
the shards read with the stdlib tar reader, the pack counts written in the plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

from packvlm.energon import PackedTaskEncoder
from prep.cli import main
from prep.energon.split import ShardSplit, nearest_split, refusal
from schemas.packed import read_packed_output
from tests.shards.oracles import pack, read_shard, tokenized_dir

TEN_PACKS, FIVE_PACKS = 3200, 6500  # pack sizes giving the test example 10 and 5 packs (asserted)


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


def _keys(root: Path, split: str) -> list[str]:
    """Pack keys of one split, loaded once by Energon."""
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    if split == "train":
        ds = get_train_dataset(
            root,
            split_part=split,
            worker_config=worker_config,
            batch_size=None,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
            task_encoder=PackedTaskEncoder(),
        )
    else:
        ds = get_val_dataset(
            root, split_part=split, worker_config=worker_config, batch_size=None, task_encoder=PackedTaskEncoder()
        )
    return [s.__key__ for s in get_loader(ds)]


def _index(root: Path, *options: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["energon-index", str(root), *options])
    return result.exit_code, result.output


def test_readme_split_ratio_on_one_shard_is_refused_not_train_0(tok, tmp_path):
    """issue 10 item 5: 10 packs in one shard with 0.98,0.02,0 gave `train 0, val 10`, exit 0."""
    out = tmp_path / "packed"
    assert pack([tok], out, pack_size=TEN_PACKS, shard_size="512MB")["packs"]["packs"] == 10
    code, output = _index(out, "--split-ratio", "0.98,0.02,0", "--verify")
    assert code == 2, output
    assert "train 10, val 0, test 0" in output and "val gets no pack" in output
    assert "prep pack" in output and "--split-ratio 0.98,0.02,0" in output and "--shard-size" in output
    assert not (out / ".nv-meta").exists()  # refused before Energon wrote anything


def test_split_recorded_by_pack_is_what_energon_loads(tok, tmp_path):
    out = tmp_path / "packed"
    pack([tok], out, pack_size=TEN_PACKS, shard_size="2packs", split_ratio=(0.6, 0.3, 0.1))
    manifest = read_packed_output(out).manifest
    assert [(s.name, s.packs) for s in manifest.splits] == [("train", 6), ("val", 3), ("test", 1)]
    code, output = _index(out, "--verify")
    assert code == 0, output
    assert "train 6, val 3, test 1" in output and "each exactly once" in output
    for s in manifest.splits:
        planned = [f"pack-{p:08d}" for p in range(s.first_pack, s.first_pack + s.packs)]
        loaded = _keys(out, s.name)
        assert sorted(loaded) == planned and len(set(loaded)) == len(loaded), s.name


def test_readme_example_packed_with_split_ratio(tok, tmp_path):
    out = tmp_path / "packed"
    pack([tok], out, pack_size=TEN_PACKS, shard_size="512MB", split_ratio=(0.98, 0.02, 0))
    code, output = _index(out, "--verify")
    assert code == 0 and "train 9, val 1, test 0" in output, output
    assert len(_keys(out, "train")) == 9 and len(_keys(out, "val")) == 1


def test_five_packs_in_two_shards_split_on_the_shard_boundary(tok, tmp_path):
    """issue 10 item 5: 5 packs in shards of 4 + 1 gave train 1, val 4 for 0.98,0.02."""
    out = tmp_path / "packed"
    pack([tok], out, pack_size=FIVE_PACKS, shard_size="4packs")
    assert [s.packs for s in read_packed_output(out).shards.shards] == [4, 1]
    code, output = _index(out, "--split-ratio", "0.98,0.02,0", "--verify")
    assert code == 0, output
    assert "train 4, val 1, test 0 (wanted train 4, val 1, test 0)" in output
    first, second = (set(read_shard(p)) for p in sorted((out / "shards").glob("*.tar")))
    assert set(_keys(out, "train")) == first and set(_keys(out, "val")) == second
    split = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert split == {"train": ["shards/shard-000000.tar"], "val": ["shards/shard-000001.tar"], "test": []}


def test_ratio_far_from_the_shard_boundaries_is_refused(tok, tmp_path):
    out = tmp_path / "packed"
    pack([tok], out, pack_size=TEN_PACKS, shard_size="5packs")
    code, output = _index(out, "--split-ratio", "0.98,0.02,0")
    assert code == 2 and "Energon splits by whole shards" in output, output
    code, output = _index(out, "--split-ratio", "0.5,0.5,0", "--verify")
    assert code == 0 and "train 5, val 5, test 0" in output, output


def test_nearest_split_and_its_tolerance():
    # 3 + 2 packs, 0.98,0.02: wanted 4, 1 -> train 3, val 2 (each off by 1 = max(1, 5 % of 5)): honoured
    split = nearest_split([3, 2], (0.98, 0.02, 0))
    assert (split.packs, split.wanted, split.bounds) == ((3, 2, 0), (4, 1, 0), (0, 1, 2, 2))
    assert refusal(split, (0.98, 0.02, 0)) is None
    # a zero ratio never gets packs when a boundary avoids it
    split = nearest_split([3, 3, 3, 1], (0.7, 0.3, 0))
    assert split.packs == (6, 4, 0)
    # 40 shards of 10 packs, 0.97,0.03: wanted 388, 12 -> 390, 10 (off by 2 <= 5 % of 400)
    split = nearest_split([10] * 40, (0.97, 0.03, 0))
    assert split.packs == (390, 10, 0) and refusal(split, (0.97, 0.03, 0)) is None
    message = refusal(ShardSplit(bounds=(0, 0, 1, 1), packs=(0, 10, 0), wanted=(9, 1, 0)), (0.98, 0.02, 0))
    assert message is not None and "train gets no pack" in message and "val is off by 9 packs" in message
