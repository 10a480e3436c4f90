"""The processor is loaded once per process (issue 28 §3): `prep tokenize` with in-process workers
loads it once for its up-front identity check and its workers together; a processor rewritten in
place between two runs of one process loads anew (its identity must follow the files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import families.processor
from families.processor import load_processor_once
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize


@pytest.fixture
def counted_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real load, by path; the cache starts empty."""
    loads: list[str] = []
    real = families.processor.load_processor

    def counting(path: str) -> families.processor.ProcessorBundle:
        loads.append(path)
        return real(path)

    families.processor._load_processor_cached.cache_clear()
    monkeypatch.setattr(families.processor, "load_processor", counting)
    return loads


def test_prep_tokenize_in_process_loads_the_processor_once(
    example_dir: Path, tmp_path: Path, counted_loads: list[str]
) -> None:
    processor = tmp_path / "processor"
    shutil.copytree(example_dir / "processor", processor)
    config = TokenizeConfig(
        dataset_config=str(example_dir / "dataset_info.json"),
        processor=str(processor),
        output_dir=str(tmp_path / "tok"),
        executor=LOCAL,
        max_error_rate=1.0,  # the example carries broken rows on purpose
    )
    manifest = run_tokenize(config)
    assert manifest.rows.samples > 0
    assert counted_loads == [str(processor)]


def test_a_processor_rewritten_in_place_loads_anew(example_dir: Path, tmp_path: Path, counted_loads: list[str]) -> None:
    processor = tmp_path / "processor"
    shutil.copytree(example_dir / "processor", processor)
    first = load_processor_once(str(processor))
    assert load_processor_once(str(processor)) is first
    config_file = processor / "preprocessor_config.json"
    settings = json.loads(config_file.read_text())
    settings["max_pixels"] = settings["max_pixels"] // 2
    config_file.write_text(json.dumps(settings))
    stat = config_file.stat()
    os.utime(config_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # coarse-mtime file systems
    second = load_processor_once(str(processor))
    assert second is not first
    assert second.identity()["sha256"] != first.identity()["sha256"]
    assert counted_loads == [str(processor)] * 2
