"""A `prep tokenize --executor ray` run that is killed or interrupted (issue 10).

- kill -9 of the driver (right after `prep.run.init_ray` started the embedded Ray): no
  process of that Ray outlives it by more than a few seconds (Ray's agents used to linger
  ~60 s, see `prep.ray_reaper`).
- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): after the signal the
  driver prints exactly one line and exits 130; no Ray Data "finished"/"failed" line, no
  "Aborted!"; rerunning the same command resumes.

Each test starts the driver in its own session, so every process Ray starts for it (its
session id, read from /proc) can be told from the rest of the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prep.example.dataset import write_example_dataset

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads the process table from /proc"),
]
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0  # Ray's agents alone took ~60 s before the reaper
INTERRUPTED = "interrupted; rerun the same command to resume"


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("interrupts")
    return write_example_dataset(root / "ex", num_samples=24, seed=7, with_bad_rows=False).parent


def _command(example: Path, out: Path, executor: str = "ray") -> list[str]:
    args = ["--dataset-config", str(example / "dataset_info.json"), "--processor", str(example / "processor")]
    args += ["--output", str(out), "--rows-per-chunk", "1", "--max-error-rate", "1", "--executor", executor]
    return [sys.executable, "-m", "prep.cli", "tokenize", *args, *(["--num-workers", "1"] if executor == "ray" else [])]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **extra}
    if "PACKVLM_CRASH_AT" not in extra:
        env.pop("PACKVLM_CRASH_AT", None)
    return env


def _session(sid: int) -> list[str]:
    """Live (non-zombie) processes of session ``sid`` other than its leader, by name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == sid:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[3]) == sid and rest[0] != "Z":
            found.append(name)
    return found


def _wait_gone(sid: int, limit_s: float) -> tuple[float, list[str]]:
    start = time.monotonic()
    left = _session(sid)
    while left and time.monotonic() - start < limit_s:
        time.sleep(0.1)
        left = _session(sid)
    return time.monotonic() - start, left


def test_kill_9_of_the_driver_leaves_no_ray_process(tmp_path: Path) -> None:
    """SIGKILL right after `init_ray` started the embedded Ray (head processes, agents, workers up)."""
    script = "import os, signal\nfrom prep.run import init_ray\ninit_ray(None, 1)\nos.kill(os.getpid(), signal.SIGKILL)"
    driver = subprocess.Popen(
        [sys.executable, "-c", script],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    seconds, left = _wait_gone(driver.pid, GONE_WITHIN_S)
    try:
        assert not left, f"still running {seconds:.1f} s after kill -9: {left}"
    finally:
        for pid in _pids(driver.pid):  # never leave them to the next test
            os.kill(pid, signal.SIGKILL)


def _pids(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(entry.name) != sid and int(rest[3]) == sid:
            out.append(int(entry.name))
    return out


def test_ctrl_c_is_one_line_and_the_same_command_resumes(example: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "tok", tmp_path / "stderr.txt"
    with log.open("wb") as sink:
        driver = subprocess.Popen(_command(example, out), env=_env(), stdout=sink, stderr=sink, start_new_session=True)
        deadline = time.monotonic() + 300
        while not list((out / "samples").glob("part-*.arrow")):  # the Ray run is under way
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        mark = log.stat().st_size
        os.killpg(driver.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        driver.wait(timeout=120)
    text = log.read_bytes()
    after = text[mark:].decode(errors="replace")
    assert driver.returncode == 130, text.decode(errors="replace")[-3000:]
    lines = [line for line in after.splitlines() if line.strip()]
    assert lines[-1] == INTERRUPTED and after.count(INTERRUPTED) == 1, after
    noise = ("finished", "failed", "Aborted", "Traceback", "(raylet)", "100%")
    assert not [line for line in lines if any(n in line for n in noise)], after
    _wait_gone(driver.pid, GONE_WITHIN_S)
    done = len(list((out / "samples").glob("part-*.arrow")))
    assert 0 < done < 24, "interrupted mid-run"
    rerun = subprocess.run(_command(example, out, "local"), env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{done} already done" in rerun.stderr
