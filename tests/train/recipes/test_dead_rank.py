"""A rank that dies and a disk that fills (issue 29): `train hf` with 2 gloo ranks, one frozen
before the gradient all-reduce (a node gone without closing its sockets) and then SIGKILLed:
the other exits non-zero within 60 s through the process-group timeout (`--dist-timeout-s`),
not a hang, and ``--resume`` under torchrun then continues exactly; a full disk while a
checkpoint is written exits 3 and leaves the previous checkpoint and ``latest`` as they were.

The interrupted ranks are started without torchrun, as one launcher per node would start them:
torchrun's agent stops the other ranks as soon as one dies, which would end the survivor whatever
its timeout. Truths: an uninterrupted torchrun run (batches, losses, weights), the checkpoint
files before the disk filled. Steps are exact (`packvlm.faults`: ``PACKVLM_FREEZE_AT``), not timed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from schemas.packed import read_packed_output
from schemas.train import CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, checkpoint_name
from tests.train.recipes.test_hf import _weights, run_inputs  # noqa: F401  (run_inputs: a fixture)
from train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[3]
DEAD_RANK_EXIT_S = 60
DIST_TIMEOUT_S = 20  # the survivor's collective gives up after this


def _args(inputs: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "-m", "train.cli", "hf",
        "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", "0", "--device", "cpu", "--lr", "1e-3",
        "--dist-timeout-s", str(DIST_TIMEOUT_S), *extra,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PACKVLM_CRASH_AT", None)
    env.pop("PACKVLM_FREEZE_AT", None)
    return {**env, **extra}


def _torchrun(inputs: dict[str, Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*cmd, *_args(inputs, out, *extra)], capture_output=True, text=True, env=_env(), timeout=600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(inputs: dict[str, Path], out: Path, *extra: str, freeze_at: str, log: Path) -> list[subprocess.Popen]:
    """Two ranks started as a launcher per node would start them (no torchrun agent to stop the
    survivor for us): only the process-group timeout can end a rank whose peer stopped answering."""
    group = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    ranks = []
    for rank in range(2):
        env = _env(**group, RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank), PACKVLM_FREEZE_AT=freeze_at)
        with (log.parent / f"{log.name}.{rank}").open("wb") as sink:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, *_args(inputs, out, *extra)], env=env, stdout=sink, stderr=subprocess.STDOUT
                )
            )
    return ranks


# in CI (not slow): ~97 CPU-s, one 20 s timeout wait (measured on the shared 2-core machine, load ~16)
def test_a_killed_rank_ends_the_run_and_resume_continues_exactly(run_inputs, tmp_path):  # noqa: F811
    num_packs = read_packed_output(run_inputs["data"]).manifest.packs.packs
    steps = max(1, num_packs // 2 // 2)
    total = 2 * steps
    whole = _torchrun(run_inputs, tmp_path / "whole", "--max-steps", str(total))
    assert whole.returncode == 0, whole.stderr[-6000:]
    # rank 1 stops answering at step steps + 1 (after the checkpoint of step `steps`), while rank 0
    # waits in the gradient all-reduce; then this test SIGKILLs it, mid-step
    split = ("--max-steps", str(total), "--save-every", str(steps))
    freeze = f"train.before_grad_all_reduce.rank1:{steps + 1}"
    survivor, dead = _ranks(run_inputs, tmp_path / "split", *split, freeze_at=freeze, log=tmp_path / "rank")
    try:
        while psutil.Process(dead.pid).status() != psutil.STATUS_STOPPED:
            assert dead.poll() is None and survivor.poll() is None, (tmp_path / "rank.0").read_text()[-4000:]
            time.sleep(0.1)
        frozen_at = time.monotonic()
        code = survivor.wait(timeout=600)
        seconds = time.monotonic() - frozen_at
    finally:
        dead.kill()
        dead.wait()
        survivor.kill()
        survivor.wait()
    log = (tmp_path / "rank.0").read_text()
    assert code == 3 and DIST_TIMEOUT_S <= seconds < DEAD_RANK_EXIT_S, (code, seconds, log[-4000:])  # environment
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 0: another rank stopped answering" in errors[0] and "--resume" in errors[0]
    latest = tmp_path / "split" / CHECKPOINTS_DIR / LATEST_FILE
    assert latest.read_text().strip() == checkpoint_name(steps)
    resumed = _torchrun(run_inputs, tmp_path / "split", "--max-steps", str(total), "--resume")
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


@pytest.mark.slow  # ~24 CPU-s: two tiny training runs (one to size the disk); needs root + tmpfs
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
