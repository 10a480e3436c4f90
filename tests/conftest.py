"""Shared fixtures: offline Qwen processors, the generated example dataset, one Ray session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FAMILIES = ("qwen2_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def processor_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from families.qwen2_vl.processor_dir import build_processor_dir

    root = tmp_path_factory.mktemp("processors")
    return {f: build_processor_dir(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def bundles(processor_dirs: dict[str, Path]) -> dict:
    from families.processor import load_processor

    return {f: load_processor(str(p)) for f, p in processor_dirs.items()}


def start_test_ray(ray) -> None:
    """A private local Ray: 2 CPUs, no dashboard, never the cluster a stale
    ``/tmp/ray/ray_current_cluster`` names (``address="local"``)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (`start_test_ray`)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        start_test_ray(ray)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated example dataset (same generator as `prep example`)."""
    from prep.example.dataset import write_example_dataset

    root = tmp_path_factory.mktemp("example")
    return write_example_dataset(root, num_samples=48, seed=0).parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow (minutes each)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` tests (embedded-Ray actor kills, a full disk) skip unless --runslow; walks over example
    families mark a torchvision-only family's case `torchvision` (skipped without torchvision)."""
    _mark_torchvision_examples(items)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _mark_torchvision_examples(items: list[pytest.Item]) -> None:
    """A case parametrized with an example of a ``needs_torchvision`` family (`families.registry`) is
    marked ``torchvision``, and skipped where torchvision does not import (its processor cannot be built)."""
    import importlib.util

    from families.registry import FAMILIES

    names = {name for family in FAMILIES if family.needs_torchvision for name in family.examples}
    missing = importlib.util.find_spec("torchvision") is None
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(value, str) and value in names for value in params.values()):
            item.add_marker(pytest.mark.torchvision)
            if missing:
                item.add_marker(pytest.mark.skip(reason="torchvision-only image processor: needs torchvision"))
