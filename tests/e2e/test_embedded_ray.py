"""The embedded Ray is always ours (issue 20): a stale ``ray_current_cluster`` file, as any
crashed ``ray start`` on the machine leaves it, must not make `prep tokenize` (or the tests'
Ray fixture) join the dead address it names; and the Ray run prints no Ray noise. Ray is pointed at a private temp dir
(``RAY_TMPDIR``), so the machine's real ``/tmp/ray`` (and any cluster running there) is untouched;
the stale address is loopback with nothing listening.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from prep.example.dataset import write_example_dataset

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
DEAD = "127.0.0.1:1"  # loopback, port 1: nothing listens
WITHIN_S = 150  # a start is ~5-20 s here; before the fix it retried the dead address ~10 min


@pytest.fixture()
def stale_env():
    """Env with ``RAY_TMPDIR`` at a short private dir whose ``ray/ray_current_cluster`` names DEAD."""
    temp = Path(tempfile.mkdtemp(prefix="r20-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text(DEAD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp)}
    env.pop("RAY_ADDRESS", None)
    env.pop("PACKVLM_CRASH_AT", None)
    yield env
    shutil.rmtree(temp, ignore_errors=True)


def test_prep_tokenize_ignores_a_stale_cluster_file(stale_env, tmp_path) -> None:
    example = write_example_dataset(tmp_path / "ex", num_samples=4, seed=3, with_bad_rows=False).parent
    args = ["--dataset-config", str(example / "dataset_info.json"), "--processor", str(example / "processor")]
    args += ["--output", str(tmp_path / "tok"), "--executor", "ray", "--num-workers", "1"]
    cmd = [sys.executable, "-m", "prep.cli", "tokenize", *args]
    result = subprocess.run(cmd, env=stale_env, capture_output=True, text=True, timeout=WITHIN_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert DEAD not in result.stderr
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["rows"]["samples"] > 0
    # and the run's console is only what the user needs (issue 20, item 10)
    assert "core_worker.cc" not in result.stderr  # Ray's error line about restartable actors
    assert "authentication" not in result.stderr.lower()  # Ray's token notices
    assert result.stderr.count("needs torchvision") <= 1  # driver and actor used to print it each


def test_the_test_fixture_ignores_a_stale_cluster_file(stale_env) -> None:
    code = "import ray; from tests.conftest import start_test_ray; start_test_ray(ray); "
    code += "print(ray.get_runtime_context().gcs_address); ray.shutdown()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=stale_env, capture_output=True, text=True, timeout=WITHIN_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() and DEAD not in result.stdout
