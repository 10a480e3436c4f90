"""Resume identity is content, not strings (issue 10): each test fails on option-string checks.

A rerun resumes only with the same options, processor (class + file hashes) and data files
(size + head/tail hash); otherwise it is refused naming what differs. Nothing is written
before the processor loads and the dataset config validates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from families.qwen2_vl.processor_dir import build_processor_dir
from prep.cli import main
from prep.example.dataset import write_example_dataset
from schemas.layout import MANIFEST_FILE, RUN_FILE


@pytest.fixture()
def example(tmp_path: Path) -> Path:
    return write_example_dataset(tmp_path / "ex", num_samples=6, seed=3, with_bad_rows=False).parent


def _tokenize(example: Path, out: Path, processor: Path | str | None = None, *extra: str):
    args = ["tokenize", "--dataset-config", str(example / "dataset_info.json"), "--output", str(out)]
    args += ["--processor", str(processor or example / "processor"), "--executor", "local", *extra]
    return CliRunner().invoke(main, args)


def test_equivalent_processor_spellings_resume(example: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    assert _tokenize(example, out).exit_code == 0
    before = (out / MANIFEST_FILE).read_text()
    monkeypatch.chdir(example)
    for spelling in (f"{example / 'processor'}/", "processor", "./processor/"):
        result = _tokenize(example, out, spelling)
        assert result.exit_code == 0, result.output
    assert json.loads((out / MANIFEST_FILE).read_text())["rows"] == json.loads(before)["rows"]


def test_another_processor_at_the_same_path_is_refused(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _tokenize(example, out).exit_code == 0
    shutil.rmtree(example / "processor")
    build_processor_dir(example / "processor", "qwen3_vl")
    result = _tokenize(example, out)
    assert result.exit_code == 2
    assert "processor.class: 'Qwen2VLProcessor' -> 'Qwen3VLProcessor'" in result.output


def test_changed_data_file_is_refused_naming_it(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _tokenize(example, out).exit_code == 0
    config = json.loads((example / "dataset_info.json").read_text())
    data = (example / "dataset_info.json").parent / config["chat"]["file_name"]
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:]))  # the first record deleted
    result = _tokenize(example, out)
    assert result.exit_code == 2 and "data_files.chat.size" in result.output


def test_a_wrong_processor_writes_nothing_and_the_fixed_command_runs(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _tokenize(example, out, tmp_path / "no-such-processor")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not out.exists()
    assert _tokenize(example, out).exit_code == 0


def test_missing_media_dir_is_a_config_error(example: Path, tmp_path: Path) -> None:
    config_path = example / "dataset_info.json"
    config = json.loads(config_path.read_text())
    config["chat"]["media_dir"] = "nowhere"
    config_path.write_text(json.dumps(config))
    result = _tokenize(example, tmp_path / "out")
    assert result.exit_code == 2 and "media_dir" in result.output and "nowhere" in result.output
    assert not (tmp_path / "out").exists()


def test_error_budget_is_per_dataset_and_raising_it_resumes(tmp_path: Path) -> None:
    example = write_example_dataset(tmp_path / "ex", num_samples=12, seed=0, with_bad_rows=True).parent
    out = tmp_path / "out"
    result = _tokenize(example, out)  # default budget 5 %: the example's deliberate bad rows exceed it
    assert result.exit_code == 1
    assert "--max-error-rate 5.0%" in result.output and "chat" in result.output and "prep errors" in result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["rows"]["errors"] > 0  # outputs kept
    run_file = (out / RUN_FILE).read_text()
    result = _tokenize(example, out, None, "--max-error-rate", "1")
    assert result.exit_code == 0, result.output
    assert (out / RUN_FILE).read_text() == run_file  # the budget is not part of the run's identity


def test_truncated_json_array_names_the_file(example: Path, tmp_path: Path) -> None:
    config = json.loads((example / "dataset_info.json").read_text())
    data = example / config["sharegpt_json"]["file_name"]
    text = data.read_text()
    data.write_text(text[: len(text) // 2])
    result = _tokenize(example, tmp_path / "out", None, "--dataset", "sharegpt_json")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert str(data) in result.output and "not a valid JSON array" in result.output


def test_another_stage_output_as_output_is_named(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _tokenize(example, out).exit_code == 0
    args = ["pack", str(out), "--output", str(out), "--pack-size", "4096", "--executor", "local"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "holds a `prep tokenize` output" in result.output
    assert "dataset_config" not in result.output  # no dump of the other stage's options
