"""`--executor auto` (the default, issue 21): Ray for a given cluster or a machine with cores to
spare, local otherwise; the choice and its reason are printed at start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from prep import run
from prep.cli import main
from prep.run import ExecutorConfig, resolve_executor, run_tasks


class Doubler:
    """A worker in the run_tasks protocol: built once, called per batch of tasks."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        return {"out": [int(t) * self.factor for t in batch["task"]]}


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("config", "cpus", "tasks", "expected"),
    [
        (ExecutorConfig(), 2, 100, "local"),
        (ExecutorConfig(), 3, 100, "local"),
        (ExecutorConfig(), 4, 100, "ray"),
        (ExecutorConfig(), 64, 1, "local"),
        (ExecutorConfig(ray_address="10.0.0.1:6379"), 2, 1, "ray"),
        (ExecutorConfig(executor="ray"), 2, 1, "ray"),
        (ExecutorConfig(executor="local"), 64, 100, "local"),
    ],
)
def test_auto_picks_by_cluster_cpus_and_tasks(
    no_cluster: pytest.MonkeyPatch, config: ExecutorConfig, cpus: int, tasks: int, expected: str
) -> None:
    no_cluster.setattr(run, "usable_cpus", lambda: cpus)
    assert resolve_executor(config, tasks).name == expected


def test_ray_address_in_the_environment_means_ray(no_cluster: pytest.MonkeyPatch) -> None:
    no_cluster.setenv("RAY_ADDRESS", "auto")
    no_cluster.setattr(run, "usable_cpus", lambda: 1)
    choice = resolve_executor(ExecutorConfig(), 5)
    assert choice.name == "ray" and "cluster address auto" in choice.reason


def test_default_on_a_small_machine_runs_in_process_and_says_why(
    no_cluster: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    no_cluster.setattr(run, "usable_cpus", lambda: 2)

    def no_ray(*args: object, **kwargs: object) -> list[dict]:
        raise AssertionError("auto started Ray on a 2-CPU machine")

    no_cluster.setattr(run, "run_ray", no_ray)
    with caplog.at_level(logging.INFO, logger="prep.run"):
        rows = run_tasks(Doubler, {"factor": 3}, ["1", "2", "5"], ExecutorConfig(), desc="double")
    assert rows == [{"out": 3}, {"out": 6}, {"out": 15}]
    assert "double: 3 tasks on the local executor (auto: no cluster address, 2 CPUs < 4)" in caplog.messages


def test_default_with_a_cluster_goes_to_ray_with_its_address(no_cluster: pytest.MonkeyPatch) -> None:
    calls = []
    no_cluster.setattr(run, "run_ray", lambda *args, **kwargs: calls.append(kwargs) or [])
    run_tasks(Doubler, {"factor": 1}, ["1"], ExecutorConfig(ray_address="ray://head:10001"), desc="double")
    assert calls and calls[0]["address"] == "ray://head:10001"


@pytest.mark.parametrize("command", ["tokenize", "pack", "shards"])
def test_cli_default_is_auto(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "[default: auto]" in result.output


def test_tokenize_command_default_executor_is_local_here(
    no_cluster: pytest.MonkeyPatch, example_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    no_cluster.setattr(run, "usable_cpus", lambda: 2)
    tok = tmp_path / "tok"
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    with caplog.at_level(logging.INFO, logger="prep.run"):
        result = CliRunner().invoke(main, ["tokenize", *args, "--output", str(tok), "--max-error-rate", "1"])
    assert result.exit_code == 0, result.output
    assert any("on the local executor (auto: no cluster address, 2 CPUs < 4)" in m for m in caplog.messages)
