"""A worker process SIGKILLed from outside on a Ray cluster (issue 29): a loopback cluster (`ray
start --head` + 2 worker nodes joined with `ray start --address`, one CPU and a resource of
their own each) runs `prep tokenize` / `prep pack` through ``RAY_ADDRESS``; one actor freezes
after its first output (``PACKVLM_FREEZE_AT``, set for this run's workers only through the job's
runtime env, as ``ray job submit --runtime-env-json`` would) and the test SIGKILLs that process,
as the OOM killer or a lost node would. The run finishes byte-identical to a clean run (Ray
retried the task) or stops with one clear error line, and the same command then finishes it
byte-identical.

Truth: the clean local run of `tests.e2e.test_fault_matrix` (same example, same output path).
The cluster lives in its own temp dir, on free loopback ports, with its own token, each node in
its own process group; teardown stops it by those groups (never `ray stop`, which stops every
Ray of the machine's user, other sessions' included).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_fault_matrix import _pack, _tokenize, _tree, clean, example, work  # noqa: F401

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this interpreter
WORKER_NODES = ("node_a", "node_b")


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    env: dict[str, str]  # for its clients: RAY_ADDRESS and the token
    workers: tuple[subprocess.Popen, ...]  # the worker nodes' `ray start --block`


def _free_port(avoid: range = range(0)) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def _node_ports(*extra: str) -> list[str]:
    """Every port a node opens, free ones, none inside its workers' range (Ray refuses a clash):
    the defaults may be held by another Ray on the machine."""
    low = _free_port()
    workers = range(low, low + 41)  # workers' gRPC ports: a small range of our own
    flags = ["--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port"]
    flags += ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", *extra]
    args = [arg for flag in flags for arg in (flag, str(_free_port(workers)))]
    return [*args, "--min-worker-port", str(workers.start), "--max-worker-port", str(workers.stop - 1)]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:  # read when the cluster does not come up
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL the node and every process it started, by its own process group (SIGTERM drains for
    seconds): a test cluster has nothing to save."""
    descendants = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for child in descendants:  # any the node put in a group of their own
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _wait_started(node: subprocess.Popen, log: Path, within_s: float = 180.0) -> None:
    """`ray start --block` logs "Ray runtime started." once its node is registered with the GCS."""
    deadline = time.monotonic() + within_s
    while b"Ray runtime started" not in log.read_bytes():
        assert node.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not started after {within_s} s: " + log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    temp = Path(tempfile.mkdtemp(prefix="r29k-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp)}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # the cluster's own token, for all
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "PACKVLM_CRASH_AT", "PACKVLM_FREEZE_AT"):
        env.pop(name, None)
    ports = _node_ports("--port", "--ray-client-server-port")
    gcs = ports[ports.index("--port") + 1]
    head = [*RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", *ports]
    head += ["--num-cpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp)]
    nodes = [_start(head, env, temp / "head.log")]
    try:
        _wait_started(nodes[0], temp / "head.log")
        for name in WORKER_NODES:  # one CPU each: one actor per node. One node at a time: nodes
            join = [*RAY, "start", "--block", "--address", f"127.0.0.1:{gcs}", "--node-ip-address", "127.0.0.1"]
            join += ["--num-cpus", "1", "--resources", json.dumps({name: 1}), "--disable-usage-stats"]
            nodes.append(_start([*join, *_node_ports()], env, temp / f"{name}.log"))
            _wait_started(nodes[-1], temp / f"{name}.log")  # started together on one IP time out at start
        client = {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}
        yield Cluster(env=client, workers=tuple(nodes[1:]))
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)


def _prep_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "prep.cli", *args, "--executor", "ray", "--num-workers", str(len(WORKER_NODES))]


def _prep(cluster: Cluster, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_prep_cmd(args), env=cluster.env, capture_output=True, text=True, timeout=600)


def _frozen(cluster: Cluster) -> list[psutil.Process]:
    """Stopped processes the worker nodes started (their actors), oldest first."""
    found = []
    for node in cluster.workers:
        for proc in psutil.Process(node.pid).children(recursive=True):
            try:
                if proc.status() == psutil.STATUS_STOPPED:
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
    return sorted(found, key=lambda p: p.create_time())


def _run_and_kill_one_actor(
    cluster: Cluster, args: list[str], freeze_at: str
) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``args`` with every actor freezing at ``freeze_at``; SIGKILL the first that does, let the others
    go on. The run's result and the killed process's id."""
    job = {"runtime_env": {"env_vars": {"PACKVLM_FREEZE_AT": freeze_at}}}  # what `ray job submit` hands its driver
    env = {**cluster.env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # files: a full pipe would block it
        run = subprocess.Popen(_prep_cmd(args), env=env, stdout=out, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 300
            while not (frozen := _frozen(cluster)):
                assert run.poll() is None, f"exited {run.returncode} before any actor froze at {freeze_at}"
                assert time.monotonic() < deadline, f"no actor froze at {freeze_at}"
                time.sleep(0.1)
            victim = frozen[0]
            assert victim.cmdline()[0].startswith("ray::"), victim.cmdline()  # a Ray worker, not a node's daemon
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)
            while run.poll() is None:  # an actor on the other node may freeze too: it goes on
                assert time.monotonic() < deadline, "the run did not end after the kill"
                for other in _frozen(cluster):
                    other.send_signal(signal.SIGCONT)
                time.sleep(0.1)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(run.args, run.returncode, out.read(), err.read()), victim.pid


def _then_finish(cluster: Cluster, killed: tuple[subprocess.CompletedProcess, int], args: list[str], out: Path, clean):  # noqa: F811
    """The killed run ended 0, or 3 with one line naming the dead actor; ``args`` rerun then finish
    ``out`` (a folder of the run) byte-identical to the clean run's."""
    first, pid = killed
    assert first.returncode in (0, 3), first.stderr[-3000:]  # done, or Ray lost an actor: an environment error
    if first.returncode != 0:  # one line saying what to do (Ray itself logs the actor's death above it)
        lines = [line for line in first.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Ray failed mid-run" in lines[0] and "rerun to resume" in lines[0], lines
        assert f"pid: {pid}" in lines[0]  # the process this test killed
    done = _prep(cluster, args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" not in done.stderr  # it joined the cluster
    folder = f"{out.name}/"
    assert {k: v for k, v in _tree(out.parent).items() if k.startswith(folder)} == {
        k: v for k, v in clean.items() if k.startswith(folder)
    }


def test_tokenize_actor_killed_on_a_cluster_finishes_or_resumes_identically(cluster, example, clean, work) -> None:  # noqa: F811
    shutil.rmtree(work)
    args = _tokenize(example, work / "tok")
    _then_finish(cluster, _run_and_kill_one_actor(cluster, args, "tokenize.after_part:1"), args, work / "tok", clean)


@pytest.mark.slow  # the tokenize case runs in CI; this one with --runslow
def test_shards_actor_killed_on_a_cluster_finishes_or_resumes_identically(cluster, example, clean, work) -> None:  # noqa: F811
    shutil.rmtree(work)
    assert _prep(cluster, _tokenize(example, work / "tok")).returncode == 0  # cleanly: only a shards actor dies
    args = _pack(work / "tok", work / "packed")
    _then_finish(cluster, _run_and_kill_one_actor(cluster, args, "shards.after_shard:1"), args, work / "packed", clean)
