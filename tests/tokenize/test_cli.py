"""The `prep` shell: exit codes, printed numbers, and resume after a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from prep.cli import main
from schemas.layout import SAMPLES_DIR


def _args(example: Path, out: Path, *extra: str) -> list[str]:
    return [
        "tokenize",
        "--dataset-config",
        str(example / "dataset_info.json"),
        "--processor",
        str(example / "processor"),
        "--output",
        str(out),
        "--executor",
        "local",
        "--rows-per-chunk",
        "4",
        "--max-error-rate",  # the example holds one bad row per reason; a later value in extra wins
        "1",
        *extra,
    ]


def test_cli_prints_numbers_and_fails_on_error_rate(example_dir, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, _args(example_dir, tmp_path / "a"))
    assert ok.exit_code == 0, ok.output
    assert "samples:" in ok.output and "error malformed_json" in ok.output and "tokens:" in ok.output
    strict = runner.invoke(main, _args(example_dir, tmp_path / "b", "--max-error-rate", "0"))
    assert strict.exit_code == 1
    assert (tmp_path / "b" / "manifest.json").exists()


def test_cli_usage_errors_are_one_line(example_dir, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.txt").write_text("not ours")
    result = CliRunner().invoke(main, _args(example_dir, tmp_path / "busy"))
    assert result.exit_code == 2
    assert "not empty" in result.output


def test_prep_example_then_tokenize(tmp_path):
    runner = CliRunner()
    assert runner.invoke(main, ["example", str(tmp_path / "ex"), "--num-samples", "8"]).exit_code == 0
    result = runner.invoke(main, _args(tmp_path / "ex", tmp_path / "out", "--verify-fraction", "1.0"))
    assert result.exit_code == 0, result.output


def test_killed_run_resumes_to_identical_output(example_dir, tmp_path):
    """SIGKILL a real `prep tokenize` mid-run, rerun it, compare with an uninterrupted run."""
    cmd = [sys.executable, "-m", "prep.cli", *_args(example_dir, tmp_path / "killed")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = tmp_path / "killed" / SAMPLES_DIR
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if samples.is_dir() and len(list(samples.glob("part-*"))) >= 2:
            break
        time.sleep(0.02)
    killed_mid_run = proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    runner = CliRunner()
    assert runner.invoke(main, _args(example_dir, tmp_path / "killed")).exit_code == 0
    assert runner.invoke(main, _args(example_dir, tmp_path / "clean")).exit_code == 0

    def tree(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert killed_mid_run
    assert tree(tmp_path / "killed") == tree(tmp_path / "clean")
