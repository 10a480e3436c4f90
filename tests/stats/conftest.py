"""Shared `prep stats` inputs: the generated example tokenized, then packed (once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from prep.cli import main

PACK_SIZE = 4096


@pytest.fixture(scope="session")
def tokenized(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prep tokenize` of the example, local executor, 8 records per part."""
    out = tmp_path_factory.mktemp("stats") / "tok"
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    args += ["--output", str(out), "--rows-per-chunk", "8", "--executor", "local", "--max-error-rate", "1"]
    result = CliRunner().invoke(main, ["tokenize", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


@pytest.fixture(scope="session")
def packed(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prep pack` (plan + shards) of the tokenized example, 4 packs per shard."""
    out = tmp_path_factory.mktemp("stats") / "packed"
    args = [str(tokenized), "--output", str(out), "--pack-size", str(PACK_SIZE), "--shard-size", "4packs"]
    result = CliRunner().invoke(main, ["pack", *args, "--executor", "local", "--max-oversize-rate", "1"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out
