"""Ctrl-C anywhere in a prep command (issue 10): one line naming what to do, exit 130, never
click's "Aborted!". The Ray path, with a real SIGINT, is tests/e2e/test_ray_interrupts.py."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from prep.cli import main


def _interrupt(*args: object, **kwargs: object) -> list[dict]:
    raise KeyboardInterrupt


def test_ctrl_c_mid_run_is_one_line_and_exit_130(example_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("prep.run.run_local", _interrupt)
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    args += ["--output", str(tmp_path / "tok"), "--executor", "local", "--max-error-rate", "1"]
    result = CliRunner().invoke(main, ["tokenize", *args])
    assert result.exit_code == 130, result.output
    assert result.stderr.strip().splitlines()[-1] == "interrupted; rerun the same command to resume"
    assert "Aborted" not in result.output and "Traceback" not in result.output
