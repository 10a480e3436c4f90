"""`prep pack` end to end on the tokenized example dataset.

Truths: the tokenized parts (read with pyarrow), the original media files and LMDB values,
the stdlib tar reader, the length column (oversize = num_tokens > pack_size), and an
uninterrupted run (determinism, resume).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.pack.stage import OversizeError, PackOutputConflict
from prep.run import LOCAL, ExecutorConfig
from prep.shards.read import MediaVanishedError
from prep.shards.readback import PackConservationError
from schemas.layout import MANIFEST_FILE, SAMPLES_DIR
from schemas.manifest import SHARDS_MANIFEST_FILE
from schemas.tokenized import TokenizedPartError
from tests.shards.oracles import (
    check_pack_against_tokenized,
    meta_of,
    npy,
    pack,
    read_packed,
    tokenized_dir,
    tokenized_rows,
)


@pytest.fixture(scope="module")
def tok(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_dir(example_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def packed(tok: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("packed") / "out"
    return out, pack([tok], out)


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_every_pack_equals_the_samples_it_names(packed, tok):
    out, manifest = packed
    rows = tokenized_rows(tok)
    packs = read_packed(out)
    assert sorted(packs) == [f"pack-{i:08d}" for i in range(manifest["packs"]["packs"])]
    for members in packs.values():
        meta = meta_of(members)
        assert meta["cu_seqlens_padded"][-1] <= manifest["pack_size"] == 1024
        check_pack_against_tokenized(
            meta, npy(members["input_ids.npy"]), npy(members["loss_mask.npy"]), members, [rows]
        )


def test_conservation_and_oversize_from_the_length_column(packed, tok):
    out, manifest = packed
    rows = tokenized_rows(tok)
    packed_ids = [s["sample_id"] for m in read_packed(out).values() for s in meta_of(m)["samples"]]
    oversize = {o["sample_id"] for o in manifest["oversize"]}
    assert len(packed_ids) == len(set(packed_ids))
    assert set(packed_ids) | oversize == set(rows) and not set(packed_ids) & oversize
    assert oversize == {sid for sid, r in rows.items() if r["num_tokens"] > 1024}
    assert oversize, "the example must exercise the oversize path"
    assert manifest["samples"] == {"total": len(rows), "packed": len(packed_ids), "oversize": len(oversize)}


def test_pack_statistics(packed, tok):
    out, manifest = packed
    stats = manifest["packs"]
    total = sum(r["num_tokens"] for r in tokenized_rows(tok).values() if r["num_tokens"] <= 1024)
    assert stats["tokens"] == total
    assert -(-total // 1024) <= stats["lb2"] <= stats["packs"]
    assert stats["efficiency"] == pytest.approx(total / (1024 * stats["packs"]), abs=1e-6)
    assert sum(stats["fill_histogram"].values()) == stats["packs"] > 10
    assert sum(int(k) * v for k, v in stats["samples_per_pack"].items()) == manifest["samples"]["packed"]
    assert all(sh["packs"] <= 4 for sh in manifest["shards"])
    assert len(manifest["inputs"][0]["manifest_sha256"]) == 64
    assert {**json.loads((out / MANIFEST_FILE).read_text()), "shards": manifest["shards"]} == manifest
    table = pa.ipc.open_file(pa.memory_map(str(out / "pack_stats.arrow"))).read_all().to_pydict()
    assert table["pack"] == list(range(stats["packs"]))
    assert sum(table["num_samples"]) == manifest["samples"]["packed"] and max(table["num_tokens"]) <= 1024
    assert [table["shard"].count(i) for i in range(len(manifest["shards"]))] == [s["packs"] for s in manifest["shards"]]


def test_rerun_is_byte_identical_and_resumes_after_loss(packed, tok, tmp_path):
    out, _ = packed
    again = tmp_path / "again"
    pack([tok], again)
    assert _tree(again) == _tree(out)
    shards = sorted((again / "shards").glob("*.tar"))
    shards[0].unlink()
    shards[-1].unlink()
    (again / "shards" / ".tmp-shard-000001.tar.999").write_bytes(b"half a shard")
    pack([tok], again)
    assert _tree(again) == _tree(out)


def test_killed_run_resumes_to_identical_output(tok, tmp_path):
    """SIGKILL a real `prep pack` between shards, rerun it, compare with an uninterrupted run."""

    def args(out: Path) -> list[str]:
        inputs = [str(tok)] * 4  # ~120 one-pack shards: time to kill it mid-run
        return [
            "pack",
            *inputs,
            "--output",
            str(out),
            "--pack-size",
            "512",
            "--shard-size",
            "1packs",
            "--executor",
            "local",
            "--max-oversize-rate",
            "1",
        ]

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "prep.cli", *args(tmp_path / "killed")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = tmp_path / "killed" / "shards"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if shards.is_dir() and len(list(shards.glob("shard-*.tar"))) >= 3:
            break
        time.sleep(0.002)
    killed_mid_run = proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed_mid_run and not (tmp_path / "killed" / SHARDS_MANIFEST_FILE).exists()  # killed mid-shards
    runner = CliRunner()
    assert runner.invoke(main, args(tmp_path / "killed")).exit_code == 0
    assert runner.invoke(main, args(tmp_path / "clean")).exit_code == 0
    assert _tree(tmp_path / "killed") == _tree(tmp_path / "clean")


def test_conservation_check_catches_a_wrong_shard(tok, tmp_path):
    out = tmp_path / "o"
    pack([tok], out)
    shards = sorted((out / "shards").glob("*.tar"))
    original = shards[0].read_bytes()
    shutil.copy(shards[1], shards[0])
    pack([tok], out)  # shards.json records shard 0's sha256: the rerun rewrites the wrong shard (issue 29)
    assert shards[0].read_bytes() == original
    shutil.copy(shards[1], shards[0])
    (out / SHARDS_MANIFEST_FILE).unlink()  # as after an interrupted run: only the read-back can tell
    with pytest.raises(PackConservationError, match="holds packs"):
        pack([tok], out)


def test_output_dir_with_other_files_or_options_is_refused(packed, tok, tmp_path):
    out, _ = packed
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PackOutputConflict, match="holds no `prep pack` run"):
        pack([tok], other)
    with pytest.raises(PackOutputConflict, match="differs: config.seed: 0 -> 1"):
        pack([tok], out, seed=1)


def test_oversize_error_names_samples(tok, tmp_path):
    with pytest.raises(OversizeError, match=r"samples \(\S+%\) exceed --pack-size 1024: \S+:\d+:\d+ \(\d+ tokens\)"):
        pack([tok], tmp_path / "o", oversize="error")
    assert not (tmp_path / "o").exists()


def test_padding_cap_and_two_inputs(tok, tmp_path):
    manifest = pack(
        [tok, tok], tmp_path / "o", pad_to_multiple_of=64, max_samples_per_pack=3, shard_size="1MB", balance_media=True
    )
    rows = tokenized_rows(tok)
    packs = read_packed(tmp_path / "o")
    for members in packs.values():
        meta = meta_of(members)
        assert len(meta["samples"]) <= 3
        assert all(c % 64 == 0 for c in meta["cu_seqlens_padded"]) and meta["cu_seqlens_padded"][-1] <= 1024
        check_pack_against_tokenized(
            meta, npy(members["input_ids.npy"]), npy(members["loss_mask.npy"]), members, [rows, rows]
        )
    seen = [(s["input"], s["sample_id"]) for m in packs.values() for s in meta_of(m)["samples"]]
    assert len(seen) == len(set(seen)) == manifest["samples"]["packed"]
    assert {i for i, _ in seen} == {0, 1}
    assert manifest["packs"]["pad_tokens"] > 0


def test_missing_or_truncated_part_is_a_clear_error(tok, tmp_path):
    broken = tmp_path / "tok"
    shutil.copytree(tok, broken)
    part = broken / SAMPLES_DIR / "part-000001.arrow"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizedPartError, match="part-000001.arrow.*truncated"):
        pack([broken], tmp_path / "o1")
    part.unlink()
    with pytest.raises(TokenizedPartError, match=r"part-000001.arrow.*missing"):
        pack([broken], tmp_path / "o2")


@pytest.fixture()
def private_example(tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the example data, tokenized, so media can be deleted."""
    from prep.example.dataset import write_example_dataset
    from prep.tokenize.stage import TokenizeConfig, run_tokenize

    root = write_example_dataset(tmp_path / "ex", num_samples=12, seed=1, with_bad_rows=False).parent
    tok = tmp_path / "tok"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(root / "dataset_info.json"),
            processor=str(root / "processor"),
            output_dir=str(tok),
            executor=LOCAL,
            max_error_rate=1.0,  # the example has deliberately bad rows
        )
    )
    return root, tok


def test_vanished_media_names_sample_and_path(private_example, tmp_path):
    root, tok = private_example
    rows = tokenized_rows(tok)
    sid, ref = next(
        (sid, m["ref"])
        for sid, r in sorted(rows.items())
        if r["num_tokens"] <= 1024
        for m in r["media"]
        if "::" not in m["ref"]
    )
    Path(ref).unlink()
    for shard_size in ("512MB", "2packs"):  # sizing uses tokenize-time sizes: found while writing
        with pytest.raises(MediaVanishedError, match="vanished since tokenize") as err:
            pack([tok], tmp_path / shard_size, shard_size=shard_size)
        assert ref in str(err.value) and "sample " in str(err.value)
        assert any(s in str(err.value) for s, r in rows.items() if ref in [m["ref"] for m in r["media"]])


def test_cli_pack_prints_the_numbers(tok, tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        main,
        [
            "pack",
            str(tok),
            "--output",
            str(out),
            "--pack-size",
            "1024",
            "--executor",
            "local",
            "--shard-size",
            "10packs",
            "--max-oversize-rate",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert f"packs: {manifest['packs']['packs']:,} (LB2 {manifest['packs']['lb2']:,}" in result.output
    assert "oversize (dropped)" in result.output and "efficiency" in result.output
    failed = CliRunner().invoke(
        main,
        [
            "pack",
            str(tok),
            "--output",
            str(tmp_path / "e"),
            "--pack-size",
            "1024",
            "--executor",
            "local",
            "--oversize",
            "error",
        ],
    )
    assert failed.exit_code == 1 and "exceed --pack-size 1024" in failed.output
    bad = CliRunner().invoke(
        main, ["pack", str(tok), "--output", str(tmp_path / "b"), "--pack-size", "1024", "--shard-size", "12 apples"]
    )
    assert bad.exit_code == 2 and "--shard-size" in bad.output


def test_defaults_never_drop_data_quietly(tok, tmp_path):
    """Issue 10: --oversize drop fails past 1 % of samples; --pack-size 1 and a padding above the pack size
    are refused; a bare --shard-size number is not silently bytes. Nothing is written by a refusal."""
    rows = tokenized_rows(tok)
    dropped = sum(r["num_tokens"] > 1024 for r in rows.values())
    assert dropped / len(rows) > 0.01
    base = ["pack", str(tok), "--executor", "local"]
    cases = [
        (["--pack-size", "1024"], 1, f"{dropped} of {len(rows)} samples"),
        (["--pack-size", "1"], 1, "--max-oversize-rate 1.0%"),
        (["--pack-size", "4096", "--pad-to-multiple-of", "8192"], 2, "--pad-to-multiple-of 8192 > --pack-size 4096"),
        (["--pack-size", "4096", "--shard-size", "10"], 2, "needs a unit"),
    ]
    for k, (extra, code, message) in enumerate(cases):
        out = tmp_path / f"o{k}"
        result = CliRunner().invoke(main, [*base, "--output", str(out), *extra])
        assert result.exit_code == code and message in result.output, (extra, result.output)
        assert not out.exists()
    result = CliRunner().invoke(
        main, [*base, "--output", str(tmp_path / "ok"), "--pack-size", "1024", "--max-oversize-rate", "0.5"]
    )
    assert result.exit_code == 0 and f"{dropped:,} oversize (dropped)" in result.output


@pytest.mark.ray
def test_ray_executor_matches_local(packed, tok, tmp_path, ray_session):
    out, _ = packed
    ray_out = tmp_path / "ray"
    pack([tok], ray_out, executor=ExecutorConfig(executor="ray", num_workers=1))
    assert _tree(ray_out) == _tree(out)


@pytest.mark.ray
def test_ray_worker_errors_surface_as_ours(private_example, tmp_path, ray_session):
    _, tok = private_example
    rows = tokenized_rows(tok)
    ref = next(m["ref"] for r in rows.values() if r["num_tokens"] <= 1024 for m in r["media"] if "::" not in m["ref"])
    Path(ref).unlink()
    with pytest.raises(MediaVanishedError, match="vanished since tokenize") as err:
        pack([tok], tmp_path / "o", shard_size="2packs", executor=ExecutorConfig(executor="ray", num_workers=1))
    assert str(err.value).startswith("sample ") and ref in str(err.value)


def test_manifest_records_the_processor_and_mixed_processors_are_refused(packed, tok, tmp_path):
    _, manifest = packed
    tokenized = json.loads((tok / MANIFEST_FILE).read_text())
    assert [i["processor"] for i in manifest["inputs"]] == [tokenized["processor"]]
    other = tmp_path / "other-tok"
    shutil.copytree(tok, other)
    foreign = {**tokenized, "processor": {**tokenized["processor"], "class": "Qwen3VLProcessor"}}
    (other / MANIFEST_FILE).write_text(json.dumps(foreign))
    result = CliRunner().invoke(
        main, ["pack", str(tok), str(other), "--output", str(tmp_path / "out"), "--pack-size", "4096"]
    )
    assert result.exit_code == 2, result.output
    assert "Qwen3VLProcessor" in result.output and "Qwen2VLProcessor" in result.output
    assert not (tmp_path / "out").exists()
