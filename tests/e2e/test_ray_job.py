"""`ray start --head` + `ray job submit -- prep tokenize ...`, as "Running on a Ray cluster" in the
README documents it (issue 20), on loopback only: the job's `prep tokenize` joins the cluster
through the ``RAY_ADDRESS`` Ray sets for it and writes the same output as a local run.

Needs the ``cluster`` extra (``pip install 'packvlm[cluster]'``, i.e. ``ray[default]``: the jobs
CLI and the dashboard that serves it). The head runs with ``RAY_TMPDIR`` at a private temp dir
and free loopback ports, token authentication with a token of its own (as Ray 2.60 enables by
default: clients need ``RAY_AUTH_MODE=token`` and the token), in its own process group, so
neither the machine's ``/tmp/ray`` nor another cluster is touched; the test stops it by that
group (never ``ray stop``, which stops every Ray on the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.example.dataset import write_example_dataset
from schemas.layout import SAMPLES_DIR

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this interpreter


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_dashboard(port: int, head: subprocess.Popen, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"no dashboard on 127.0.0.1:{port} after {within_s} s")


def _wait_for_job_agent(address: str, env: dict[str, str], within_s: float = 120.0) -> None:
    """The dashboard port opens before the node's job agent registers ("No available agent to
    submit job"): the cluster is ready for jobs once a no-op job runs to completion."""
    deadline = time.monotonic() + within_s
    noop = [*RAY, "job", "submit", "--address", address, "--", sys.executable, "-c", "pass"]
    while time.monotonic() < deadline:
        done = subprocess.run(noop, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            return
        assert "No available agent" in done.stderr + done.stdout, done.stderr[-3000:]
        time.sleep(1.0)
    raise AssertionError(f"no job agent on {address} after {within_s} s")


@pytest.fixture()
def head():
    """A one-node loopback cluster: ``(env for its clients, jobs address)``."""
    pytest.importorskip("ray.dashboard.optional_deps", reason="needs packvlm[cluster] (ray[default])")
    temp = Path(tempfile.mkdtemp(prefix="r20j-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp)}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # the cluster's own token, for all
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    gcs, dashboard = _free_port(), _free_port()
    cmd = [*RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs)]
    cmd += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--num-cpus", "2"]
    cmd += ["--include-dashboard", "true", "--disable-usage-stats"]
    # The agent's own ports too: their defaults (e.g. 52365) may be held by another Ray on the
    # machine (the test session's embedded Ray), and then no job agent ever registers.
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port"):
        cmd += [flag, str(_free_port())]
    cmd += ["--metrics-export-port", str(_free_port())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_dashboard(dashboard, proc)
        _wait_for_job_agent(f"http://127.0.0.1:{dashboard}", env)
        yield env, f"http://127.0.0.1:{dashboard}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the head and everything it started, by our own group id
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _samples(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / SAMPLES_DIR).glob("part-*.arrow"))}


def test_ray_job_submit_runs_prep_tokenize_on_the_cluster(head, tmp_path) -> None:
    env, address = head
    example = write_example_dataset(tmp_path / "ex", num_samples=4, seed=11, with_bad_rows=False).parent
    args = ["--dataset-config", str(example / "dataset_info.json"), "--processor", str(example / "processor")]
    args += ["--rows-per-chunk", "2", "--max-error-rate", "1"]
    job = [*RAY, "job", "submit", "--address", address, "--", sys.executable, "-m", "prep.cli", "tokenize", *args]
    job += ["--output", str(tmp_path / "on-cluster"), "--num-workers", "1"]
    done = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "succeeded" in done.stdout + done.stderr
    assert "Started a local Ray instance" not in done.stdout + done.stderr  # it joined the cluster
    local = CliRunner().invoke(main, ["tokenize", *args, "--output", str(tmp_path / "local"), "--executor", "local"])
    assert local.exit_code == 0, local.output
    assert _samples(tmp_path / "on-cluster") == _samples(tmp_path / "local")
