"""Chunk planning and sample_ratio draws, against the files themselves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prep.sources.records import plan_chunks, read_chunk, record_copies
from schemas.dataset_config import ConfigError, load_dataset_config


def _write(tmp_path: Path, lines: list[bytes], trailing_newline: bool = True, ratio: float = 1.0) -> Path:
    data = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    (tmp_path / "d.jsonl").write_bytes(data)
    cfg = tmp_path / "dataset_info.json"
    cfg.write_text(json.dumps({"d": {"file_name": "d.jsonl", "sample_ratio": ratio}}))
    return cfg


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 4, 7, 100])
@pytest.mark.parametrize("trailing", [True, False])
def test_chunks_cover_every_physical_line_once(tmp_path, rows_per_chunk, trailing):
    lines = [json.dumps({"i": i}).encode() for i in range(12)]
    lines[5] = b""  # a blank line is still a row
    specs = load_dataset_config(_write(tmp_path, lines, trailing))
    chunks = plan_chunks(specs, rows_per_chunk=rows_per_chunk, seed=0)
    records = [r for c in chunks for r in read_chunk(c)]
    assert [r.line for r in records] == list(range(12))
    assert [r.raw for r in records] == lines
    assert [c.index for c in chunks] == list(range(len(chunks)))


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0, 1.5, 2.0, 2.3])
def test_sample_ratio_counts(ratio):
    copies = record_copies(1000, ratio, seed=3, dataset="d")
    assert copies.sum() == int(np.floor(ratio)) * 1000 + round((ratio - np.floor(ratio)) * 1000)
    assert set(np.unique(copies)) <= {int(np.floor(ratio)), int(np.floor(ratio)) + 1}
    assert np.array_equal(copies, record_copies(1000, ratio, seed=3, dataset="d"))
    assert ratio == int(ratio) or not np.array_equal(copies, record_copies(1000, ratio, seed=4, dataset="d"))


def test_config_errors_say_what_to_fix(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"d": {"file_name": "missing.jsonl"}}))
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset_config(cfg)
    (tmp_path / "x.jsonl").write_text("{}\n")
    cfg.write_text(json.dumps({"d": {"file_name": "x.jsonl", "colums": {}}}))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_dataset_config(cfg)
