"""One exit code per kind of failure (issue 20), for `prep` and `train` alike.

The README's table is the contract: each code in it is `packvlm.errors.ExitCode`, every error
class of the code base derives from exactly one of the four bases, and a fault of each kind
injected into a real command (fault-matrix style) ends with that kind's code and one line.
Errors raised inside a worker come back with their class (`prep.run.ErrorCarrier`).
"""

from __future__ import annotations

import errno
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from packvlm.errors import (
    DataBudgetError,
    ExitCode,
    InternalError,
    PackvlmError,
    ResourceError,
    UsageError,
    error_from_payload,
    error_payload,
)
from prep.cli import main as prep_main
from prep.run import ERROR_COLUMN, ErrorCarrier, RayUnavailableError, WorkerBug, WorkerResourceError
from prep.tokenize.stage import ConservationError, ErrorRateExceeded
from schemas.dataset_config import ConfigError
from train.cli import main as train_main

ROOT = Path(__file__).resolve().parents[1]
BASES = (DataBudgetError, UsageError, ResourceError, InternalError)


def test_readme_table_lists_each_exit_code_once() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- exit-codes:start -->")[1].split("<!-- exit-codes:end -->")[0]
    codes = [int(m) for m in re.findall(r"^\| (\d+) \|", block, flags=re.M)]
    assert codes == sorted(set(codes)) == sorted(c.value for c in ExitCode)
    assert {base.exit_code for base in BASES} | {ExitCode.OK, ExitCode.INTERRUPTED} == set(ExitCode)


# modules that subclass an optional package's classes, so import only where it is installed
OPTIONAL_BASES = {"train.bridge_data": "megatron.bridge"}


def _all_subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct, *_all_subclasses(direct)}}


def test_every_error_class_has_one_kind_and_crosses_workers_with_its_class() -> None:
    for package in ("schemas", "prep", "train", "families", "packvlm"):
        for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as missing:  # only a module that exists to extend an optional package
                if not (missing.name or "").startswith(OPTIONAL_BASES.get(info.name, "\0")):
                    raise
    classes = _all_subclasses(PackvlmError) - set(BASES)
    assert len(classes) >= 30
    for cls in classes:
        kinds = [base for base in BASES if issubclass(cls, base)]
        assert len(kinds) == 1, (cls, kinds)
        back = error_from_payload(error_payload(cls("what to fix")))
        assert type(back) is cls and str(back) == "what to fix" and back.exit_code == kinds[0].exit_code


class _Broken:
    def __init__(self, fault: BaseException | None) -> None:
        if fault is not None:
            raise fault

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        raise ErrorRateExceeded(f"task {batch['task'][0]} over budget")


def test_a_worker_error_comes_back_as_a_row_with_its_class_and_kind() -> None:
    cases = [  # (raised in the worker, class the driver raises, exit code, message)
        (None, ErrorRateExceeded, ExitCode.DATA, "task 7 over budget"),
        (ConfigError("bad config key"), ConfigError, ExitCode.USAGE, "bad config key"),
        (OSError(errno.ENOSPC, "No space left"), WorkerResourceError, ExitCode.RESOURCE, "no space left on the device"),
        (KeyError("oops"), WorkerBug, ExitCode.INTERNAL, "KeyError in a worker: 'oops'"),
    ]
    for fault, cls, code, message in cases:
        row = ErrorCarrier(_Broken, {"fault": fault})({"task": ["7"]})
        back = error_from_payload(row[ERROR_COLUMN][0])
        assert type(back) is cls and back.exit_code == code and message in str(back)
        assert "Traceback" in "".join(back.__notes__)  # the worker's, shown with --debug


FAULTS = [  # (raised inside the command, exit code, what the one line says)
    (ErrorRateExceeded("dataset over budget"), ExitCode.DATA, "error: dataset over budget"),
    (ConfigError("file_name missing"), ExitCode.USAGE, "file_name missing"),
    (OSError(errno.ENOSPC, "No space left on device"), ExitCode.RESOURCE, "no space left on the device"),
    (RayUnavailableError("cannot join the Ray cluster"), ExitCode.RESOURCE, "cannot join the Ray cluster"),
    (PermissionError(errno.EACCES, "Permission denied"), ExitCode.RESOURCE, "Permission denied"),
    (MemoryError(), ExitCode.RESOURCE, "MemoryError"),
    (ConservationError("3 rows lost"), ExitCode.INTERNAL, "error: 3 rows lost"),
    (KeyError("oops"), ExitCode.INTERNAL, "a bug in packvlm"),
    (KeyboardInterrupt(), ExitCode.INTERRUPTED, "interrupted"),
]


@pytest.mark.parametrize(("fault", "code", "line"), FAULTS, ids=[type(f[0]).__name__ for f in FAULTS])
def test_prep_exit_code_per_kind(fault, code, line, example_dir, tmp_path, monkeypatch) -> None:
    def raise_fault(*args: object, **kwargs: object) -> list[dict]:
        raise fault

    monkeypatch.setattr("prep.run.run_local", raise_fault)
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    result = CliRunner().invoke(prep_main, ["tokenize", *args, "--output", str(tmp_path / "t"), "--executor", "local"])
    assert result.exit_code == code, result.output
    assert line in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("fault", "code", "line"), FAULTS, ids=[type(f[0]).__name__ for f in FAULTS])
def test_train_exit_code_per_kind(fault, code, line, tmp_path, monkeypatch) -> None:
    def raise_fault(config: object) -> list:
        raise fault

    monkeypatch.setattr("train.recipes.hf.run", raise_fault)
    args = ["--data", str(tmp_path), "--model", str(tmp_path), "--processor", str(tmp_path)]
    result = CliRunner().invoke(train_main, ["hf", *args, "--output", str(tmp_path / "run"), "--max-steps", "1"])
    assert result.exit_code == code, result.output
    assert line in result.output and "Traceback" not in result.output


def test_real_failures_of_each_kind(example_dir, tmp_path) -> None:
    """Without injection: a usage error and a data budget from the example's own bad rows."""
    args = ["--processor", str(example_dir / "processor"), "--executor", "local"]
    missing = CliRunner().invoke(
        prep_main, ["tokenize", "--dataset-config", str(tmp_path / "none.json"), *args, "--output", str(tmp_path / "a")]
    )
    assert missing.exit_code == ExitCode.USAGE
    config = ["--dataset-config", str(example_dir / "dataset_info.json")]
    strict = CliRunner().invoke(
        prep_main, ["tokenize", *config, *args, "--output", str(tmp_path / "b"), "--max-error-rate", "0"]
    )
    assert strict.exit_code == ExitCode.DATA and "error rate over --max-error-rate" in strict.output


def test_a_local_ray_that_does_not_start_is_an_environment_error(monkeypatch) -> None:
    import ray

    from prep.run import init_ray

    def timed_out(**kwargs: object) -> None:
        assert kwargs.get("address") == "local"  # never a cluster named by Ray's bootstrap file
        raise Exception("The current node timed out during startup.")  # what ray.init raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayUnavailableError, match="cannot start a local Ray: The current node timed out"):
        init_ray(None, None)
