"""`prep pack --split-ratio`: packs split in plan order, shards cut at split boundaries.

Truths: a brute-force search over every count vector (rounding), the shards read with the
stdlib tar reader (which packs each shard holds), the plan rows.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.pack.shard_cut import cut_shards, cut_split_shards, parse_shard_size
from schemas.manifest import PackManifest
from schemas.plan import PLAN_FILE, read_plan
from schemas.splits import SPLIT_NAMES, split_offsets, split_pack_counts
from tests.shards.oracles import pack, read_shard, tokenized_dir

TEN_PACKS = 3200  # pack size giving the test example 10 packs (asserted below)


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


def _sse(counts: tuple[int, ...], ratio: tuple[float, ...], n: int) -> float:
    total = sum(ratio)
    return sum((c - r / total * n) ** 2 for c, r in zip(counts, ratio))


def _brute_force(ratio: tuple[float, float, float], n: int) -> float:
    """Smallest squared distance to the quotas over all counts summing to n, every non-zero
    ratio getting >= 1 pack when n allows."""
    need_one = n >= sum(r > 0 for r in ratio)
    best = float("inf")
    for a, b in itertools.product(range(n + 1), repeat=2):
        counts = (a, b, n - a - b)
        if counts[2] < 0 or (need_one and any(r > 0 and c == 0 for r, c in zip(ratio, counts))):
            continue
        best = min(best, _sse(counts, ratio, n))
    return best


RATIOS = [
    (0.98, 0.02, 0.0),
    (1.0, 0.0, 0.0),
    (1.0, 1.0, 1.0),
    (0.5, 0.25, 0.25),
    (0.7, 0.2, 0.1),
    (3.0, 1.0, 0.0),
    (0.9, 0.0, 0.1),
    (0.001, 0.998, 0.001),
]


@pytest.mark.parametrize(
    "ratio", RATIOS + [tuple(random.Random(i).random() + (i == 0) for _ in range(3)) for i in range(6)]
)
def test_split_counts_are_the_closest_counts_a_brute_force_finds(ratio):
    for n in range(0, 31):
        counts = split_pack_counts(ratio, n)
        assert sum(counts) == n and min(counts) >= 0
        assert all(c == 0 for c, r in zip(counts, ratio) if r == 0)
        if n >= sum(r > 0 for r in ratio):
            assert all(c >= 1 for c, r in zip(counts, ratio) if r > 0)
        assert _sse(counts, ratio, n) == pytest.approx(_brute_force(ratio, n), abs=1e-9), (ratio, n, counts)


def test_split_counts_examples():
    assert split_pack_counts((0.98, 0.02, 0), 10) == (9, 1, 0)
    assert split_pack_counts((0.98, 0.02, 0), 5) == (4, 1, 0)
    assert split_pack_counts((0.98, 0.02, 0), 1) == (1, 0, 0)  # too few packs for val
    assert split_pack_counts((0.5, 0.5, 0), 5) == (3, 2, 0)  # a tie goes to the earlier split
    assert split_pack_counts((1, 0, 0), 7) == (7, 0, 0)
    assert split_offsets((9, 1, 0)) == (0, 9, 10, 10)


def test_cut_split_shards_restarts_at_each_split_and_equals_cut_shards_for_one_split():
    size = parse_shard_size("700B")
    pack_bytes = np.full(5, 300, np.int64)
    offsets, names = cut_split_shards(pack_bytes, size, (0, 3, 5, 5), SPLIT_NAMES)
    assert offsets.tolist() == [0, 2, 3, 5] and names == ("train", "train", "val")
    rng = np.random.default_rng(0)
    for _ in range(20):
        pack_bytes = rng.integers(1, 1000, rng.integers(0, 40))
        for size in (parse_shard_size("1500B"), parse_shard_size("3packs")):
            offsets, names = cut_split_shards(
                pack_bytes, size, (0, pack_bytes.size, pack_bytes.size, pack_bytes.size), SPLIT_NAMES
            )
            assert offsets.tolist() == cut_shards(pack_bytes, size).tolist() and set(names) <= {"train"}


def _shard_packs(out: Path) -> list[list[int]]:
    return [
        [int(key.split("-")[1]) for key in read_shard(path)] for path in sorted((out / "shards").glob("shard-*.tar"))
    ]


def test_split_ratio_splits_packs_in_plan_order_and_no_shard_spans_two_splits(tok, tmp_path):
    out = tmp_path / "p"
    manifest = PackManifest.from_json(
        pack([tok], out, pack_size=TEN_PACKS, shard_size="3packs", split_ratio=(0.98, 0.02, 0))
    )
    assert manifest.packs.packs == 10
    splits = {s.name: s for s in manifest.splits}
    assert [(s.name, s.packs, s.shards, s.first_pack, s.first_shard) for s in manifest.splits] == [
        ("train", 9, 3, 0, 0),
        ("val", 1, 1, 9, 3),
        ("test", 0, 0, 10, 4),
    ]
    plan, rows = read_plan(out / PLAN_FILE)
    assert plan.shard_offsets == (0, 3, 6, 9, 10) and plan.shard_splits == ("train", "train", "train", "val")
    packs_of_shard = _shard_packs(out)
    for shard, packs in enumerate(packs_of_shard):
        split = splits[plan.shard_splits[shard]]
        assert all(split.first_pack <= p < split.first_pack + split.packs for p in packs)
    assert sorted(p for ps in packs_of_shard for p in ps) == list(range(10))
    pack_rows = rows.column("pack").to_numpy()
    assert [s.samples for s in manifest.splits] == [
        int(((pack_rows >= s.first_pack) & (pack_rows < s.first_pack + s.packs)).sum()) for s in manifest.splits
    ]
    assert sum(s.samples for s in manifest.splits) == manifest.samples.packed


def test_cli_split_ratio_summary_and_bad_ratios(tok, tmp_path):
    runner = CliRunner()
    args = ["pack", str(tok), "--pack-size", str(TEN_PACKS), "--shard-size", "3packs", "--executor", "local"]
    args += ["--max-oversize-rate", "1"]
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "a"), "--split-ratio", "0.98,0.02,0"])
    assert result.exit_code == 0, result.output
    assert "splits: train 9 packs in 3 shards, val 1 pack in 1 shard" in result.output
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "splits: train 10 packs in 4 shards" in result.output
    for bad in ("0,1,0", "0.9,0.1", "a,b,c", "1,-1,0"):
        result = runner.invoke(main, [*args, "--output", str(tmp_path / "c"), "--split-ratio", bad])
        assert result.exit_code == 2 and "--split-ratio" in result.output, (bad, result.output)
    assert not (tmp_path / "c").exists()


def test_a_version_2_pack_manifest_reads_as_everything_in_train(tok, tmp_path):
    raw = pack([tok], tmp_path / "p", pack_size=TEN_PACKS)
    raw.pop("shards")
    old = {**raw, "schema_version": 2}
    old.pop("splits")
    manifest = PackManifest.from_json(json.loads(json.dumps(old)))
    assert manifest.splits == PackManifest.from_json(raw).splits
    assert [(s.name, s.packs) for s in manifest.splits] == [("train", 10), ("val", 0), ("test", 0)]
