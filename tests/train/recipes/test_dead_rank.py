"""A rank that dies and a disk that fills (issue 29): `train hf` under torchrun with 2 gloo ranks,
one SIGKILLed before the gradient all-reduce, ends non-zero within 60 s (no hang) and
``--resume`` then continues exactly; a full disk while a checkpoint is written exits 3 and
leaves the previous checkpoint and ``latest`` as they were.

Truths: an uninterrupted run (batches, losses, weights), the checkpoint files before the disk
filled. Kills are exact (`packvlm.faults`: ``PACKVLM_CRASH_AT``), not timed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from schemas.packed import read_packed_output
from schemas.train import CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, checkpoint_name
from tests.train.recipes.test_hf import _weights, run_inputs  # noqa: F401  (run_inputs: a fixture)
from train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[3]
DEAD_RANK_EXIT_S = 60


def _torchrun(inputs: dict[str, Path], out: Path, *extra: str, crash_at: str | None = None):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "train.cli", "hf",
        "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", "0", "--device", "cpu", "--lr", "1e-3", "--dist-timeout-s", "30",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PACKVLM_CRASH_AT", None)
    if crash_at:
        env["PACKVLM_CRASH_AT"] = crash_at
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return done, time.monotonic() - started


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_resume_continues_exactly(run_inputs, tmp_path):  # noqa: F811
    num_packs = read_packed_output(run_inputs["data"]).manifest.packs.packs
    steps = max(1, num_packs // 2 // 2)
    total = 2 * steps
    whole, _ = _torchrun(run_inputs, tmp_path / "whole", "--max-steps", str(total))
    assert whole.returncode == 0, whole.stderr[-6000:]
    # rank 1 dies at step steps + 1, after the checkpoint of step `steps`, while rank 0 waits in the all-reduce
    killed, seconds = _torchrun(
        run_inputs,
        tmp_path / "split",
        "--max-steps", str(total), "--save-every", str(steps),
        crash_at=f"train.before_grad_all_reduce.rank1:{steps + 1}",
    )  # fmt: skip
    assert killed.returncode != 0 and seconds < DEAD_RANK_EXIT_S, (seconds, killed.stderr[-4000:])
    latest = tmp_path / "split" / CHECKPOINTS_DIR / LATEST_FILE
    assert latest.read_text().strip() == checkpoint_name(steps)
    resumed, _ = _torchrun(run_inputs, tmp_path / "split", "--max-steps", str(total), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    want, got = read_metrics(tmp_path / "whole" / METRICS_FILE), read_metrics(tmp_path / "split" / METRICS_FILE)
    assert [m["pack_keys"] for m in got] == [m["pack_keys"] for m in want]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-5)
    a, b = _weights(tmp_path / "whole", total), _weights(tmp_path / "split", total)
    for name in a:  # fp32 sums over 2 ranks in the same order: the tolerance of the existing torchrun test
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]).returncode == 0


def _train(inputs: dict[str, Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train.cli", "hf", "--data", str(inputs["data"]), "--model", str(inputs["model"])]
    cmd += ["--processor", str(inputs["processor"]), "--output", str(out), "--num-workers", "0", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=600)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # ~70 s here: two tiny training runs (one to size the disk)
def test_a_full_disk_during_a_checkpoint_exits_3_and_keeps_the_previous_one(run_inputs, tmp_path):  # noqa: F811
    probe = _train(run_inputs, tmp_path / "probe", "--max-steps", "1")
    assert probe.returncode == 0, probe.stderr[-4000:]
    one_checkpoint = sum(len(b) for b in _files(tmp_path / "probe" / CHECKPOINTS_DIR).values())
    run_dir_bytes = sum(len(b) for b in _files(tmp_path / "probe").values())
    disk = tmp_path / "disk"
    # room for the run directory with one checkpoint and half of a second: step 2's save fills it
    if not _mount_tmpfs(disk, run_dir_bytes + one_checkpoint // 2 + 256 * 1024):
        pytest.skip("needs root and tmpfs to simulate a full disk")
    try:
        result = _train(run_inputs, disk / "run", "--max-steps", "2", "--save-every", "1")
        assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-4000:]
        assert "no space left on the device" in result.stderr and "Traceback" not in result.stderr
        checkpoints = disk / "run" / CHECKPOINTS_DIR
        assert (checkpoints / LATEST_FILE).read_text().strip() == checkpoint_name(1)
        kept = _files(checkpoints / checkpoint_name(1))  # whole: every file the probe's step 1 has
        assert kept.keys() == _files(tmp_path / "probe" / CHECKPOINTS_DIR / checkpoint_name(1)).keys()
        assert not (checkpoints / checkpoint_name(2)).exists()
        probe_weights = _weights(tmp_path / "probe", 1)
        for name, tensor in _weights(disk / "run", 1).items():  # the same step-1 model, whole
            assert torch.equal(tensor, probe_weights[name]), name
    finally:
        subprocess.run(["umount", "--lazy", str(disk)])  # lazy: a busy mount never outlives the test
