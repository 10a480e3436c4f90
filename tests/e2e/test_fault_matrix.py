"""The kill -9 fault matrix (issue 10): a run killed at each durable step, rerun with the same
command, ends byte-identical to an uninterrupted run; a full disk is one clear error, and the
rerun after freeing space completes identically.

Kills are exact: ``PACKVLM_CRASH_AT`` (packvlm/faults.py) SIGKILLs the process at a named step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prep.example.dataset import write_example_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    return write_example_dataset(root / "ex", num_samples=12, seed=5, with_bad_rows=False).parent


def _prep(args: list[str], crash_at: str | None = None, executor: str = "local") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("PACKVLM_CRASH_AT", None)
    if crash_at:
        env["PACKVLM_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "prep.cli", *args, "--executor", executor]
    if executor == "ray":
        cmd += ["--num-workers", "1"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _tokenize(example: Path, out: Path) -> list[str]:
    config = str(example / "dataset_info.json")
    return [
        "tokenize",
        "--dataset-config",
        config,
        "--processor",
        str(example / "processor"),
        "--output",
        str(out),
        "--rows-per-chunk",
        "4",
        "--max-error-rate",
        "1",
    ]


def _pack(tok: Path, out: Path) -> list[str]:
    return [
        "pack",
        str(tok),
        "--output",
        str(out),
        "--pack-size",
        "2048",
        "--shard-size",
        "1packs",
        "--max-oversize-rate",
        "1",
    ]


def _pipeline(example: Path, root: Path, crash_at: str | None = None, executor: str = "local") -> list[int]:
    """tokenize then pack into ``root``; the return codes (a killed step stops the pipeline)."""
    codes = [_prep(_tokenize(example, root / "tok"), crash_at, executor).returncode]
    if codes[-1] == 0:
        codes.append(_prep(_pack(root / "tok", root / "packed"), crash_at, executor).returncode)
    return codes


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One output path for every run: outputs record absolute input paths, so runs compare at the same path."""
    return tmp_path_factory.mktemp("work") / "run"


@pytest.fixture(scope="module")
def clean(example: Path, work: Path) -> dict[str, bytes]:
    shutil.rmtree(work, ignore_errors=True)
    assert _pipeline(example, work) == [0, 0]
    return _tree(work)


POINTS = [
    ("tokenize.after_part:2", "local"),
    ("tokenize.before_manifest", "local"),
    ("pack.before_manifest", "local"),
    ("shards.after_shard:2", "local"),
    ("shards.before_manifest", "local"),
    pytest.param("tokenize.before_manifest", "ray", marks=pytest.mark.ray),
    pytest.param("shards.before_manifest", "ray", marks=pytest.mark.ray),
]


@pytest.mark.parametrize(("crash_at", "executor"), POINTS)
def test_kill_at_each_step_then_rerun_is_byte_identical(example, clean, work, crash_at, executor) -> None:
    shutil.rmtree(work)
    codes = _pipeline(example, work, crash_at, executor)
    assert codes[-1] == -9, f"not killed at {crash_at}: {codes}"
    assert _pipeline(example, work, None, executor) == [0, 0]
    assert _tree(work) == clean


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


def test_full_disk_is_one_message_and_the_rerun_after_freeing_space_is_identical(example, clean, work) -> None:
    shutil.rmtree(work)
    disk = work
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("needs root and tmpfs to simulate a full disk")
    try:
        filler = disk / "filler"
        free = shutil.disk_usage(disk).free
        filler.write_bytes(b"\0" * (free - 64 * 1024))  # leave 64 KiB: tokenize needs more
        result = _prep(_tokenize(example, disk / "tok"))
        assert result.returncode == 3 and "no space left on the device" in result.stderr  # environment
        assert "Traceback" not in result.stderr
        filler.unlink()
        assert _pipeline(example, disk) == [0, 0]
        assert _tree(disk) == clean
    finally:
        subprocess.run(["umount", str(disk)])
        shutil.rmtree(disk, ignore_errors=True)
