"""`prep errors` on real `prep tokenize` and `prep pack` outputs of the generated example.

Truths, read independently of the command: the errors parts with plain pyarrow (counts,
first rows per reason in part order), the generator's ``expected.json`` (which line of
``chat.jsonl`` fails with which reason) and the samples parts' ``num_tokens`` (oversize).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from prep.cli import main
from prep.errors import error_summary
from schemas.layout import ERRORS_DIR, SAMPLES_DIR

PACK_SIZE = 1024
EXAMPLE_KEYS = ("sample_id", "dataset", "source", "line", "copy", "message")


@pytest.fixture(scope="module")
def tokenized(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prep tokenize` of the example, local executor, 16 records per part (5 parts)."""
    out = tmp_path_factory.mktemp("errors") / "tok"
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    args += ["--output", str(out), "--rows-per-chunk", "16", "--executor", "local", "--max-error-rate", "1"]
    result = CliRunner().invoke(main, ["tokenize", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


@pytest.fixture(scope="module")
def packed(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prep pack --plan-only` of the tokenized example: the manifest holds the oversize report."""
    out = tmp_path_factory.mktemp("errors") / "packed"
    args = [str(tokenized), "--output", str(out), "--pack-size", str(PACK_SIZE), "--oversize", "drop"]
    args += ["--max-oversize-rate", "1"]
    result = CliRunner().invoke(main, ["pack", *args, "--plan-only", "--executor", "local"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


def _rows(root: Path, table: str = ERRORS_DIR) -> list[dict[str, Any]]:
    """Every row of one table, part by part, read with plain pyarrow."""
    rows: list[dict[str, Any]] = []
    for part in sorted((root / table).glob("part-*.arrow")):
        rows.extend(pa.ipc.open_file(pa.memory_map(str(part))).read_all().to_pylist())
    return rows


def _truth(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Reasons most frequent first (ties by name), each with its first ``limit`` rows."""
    counts = Counter(r["reason"] for r in rows)
    order = sorted(counts, key=lambda r: (-counts[r], r))
    return [
        {
            "reason": reason,
            "count": counts[reason],
            "examples": [{k: r[k] for k in EXAMPLE_KEYS} for r in rows if r["reason"] == reason][:limit],
        }
        for reason in order
    ]


def _errors(*args: str) -> Result:
    return CliRunner().invoke(main, ["errors", *args])


def _json(*args: str) -> dict[str, Any]:
    result = _errors(*args, "--json")
    assert result.exit_code == 0, result.output + repr(result.exception)
    out: dict[str, Any] = json.loads(result.output)
    return out


def test_counts_and_examples_match_the_errors_tables(tokenized: Path) -> None:
    rows = _rows(tokenized)
    samples = len(_rows(tokenized, SAMPLES_DIR))
    report = _json(str(tokenized), "--limit", "2")
    assert report["stage"] == "tokenize"
    assert (report["errors"], report["rows"]) == (len(rows), len(rows) + samples)
    assert report["reasons"] == _truth(rows, 2)
    assert sum(g["count"] for g in report["reasons"]) == len(rows) > 0


def test_text_output_groups_by_reason_with_examples(tokenized: Path) -> None:
    rows = _rows(tokenized)
    result = _errors(str(tokenized), "--limit", "1")
    assert result.exit_code == 0, result.output
    headers = [line.split(":")[0] for line in result.output.splitlines() if line and not line.startswith((" ", "("))]
    assert headers[1:] == [g["reason"] for g in _truth(rows, 1)]
    for group in _truth(rows, 1):
        first = group["examples"][0]
        assert f"{group['reason']}: {group['count']} row" in result.output
        assert f"  {first['sample_id']}  {first['source']}:{first['line']}  " in result.output
    assert f"{len(rows)} error rows" in result.output.splitlines()[0]


def test_dataset_filter_matches_the_generator_oracle(tokenized: Path, example_dir: Path) -> None:
    expected = json.loads((example_dir / "expected.json").read_text())["chat"]["errors"]
    report = _json(str(tokenized), "--dataset", "chat", "--limit", "100")
    assert report["datasets"] == ["chat"]
    assert {g["reason"]: g["count"] for g in report["reasons"]} == Counter(expected.values())
    got = {str(e["line"]): g["reason"] for g in report["reasons"] for e in g["examples"]}
    assert got == expected
    assert {e["dataset"] for g in report["reasons"] for e in g["examples"]} == {"chat"}


def test_reason_filter(tokenized: Path) -> None:
    rows = _rows(tokenized)
    report = _json(str(tokenized), "--reason", "corrupt_image", "--reason", "missing_media", "--reason", "too_long")
    truth = {g["reason"]: g for g in _truth(rows, 5)}
    by_reason = {g["reason"]: g for g in report["reasons"]}
    assert set(by_reason) == {"corrupt_image", "missing_media", "too_long"}
    assert by_reason["corrupt_image"] == truth["corrupt_image"]
    assert by_reason["missing_media"] == truth["missing_media"]
    assert by_reason["too_long"] == {"reason": "too_long", "count": 0, "examples": []}


def test_reason_and_dataset_together(tokenized: Path) -> None:
    rows = [r for r in _rows(tokenized) if r["dataset"] == "sharegpt_json" and r["reason"] == "missing_media"]
    report = _json(str(tokenized), "--dataset", "sharegpt_json", "--reason", "missing_media", "--limit", "1")
    assert report["reasons"] == _truth(rows, 1)
    assert report["reasons"][0]["count"] == 2  # sample_ratio 1.5 copies the bad record


def test_limit_zero_prints_counts_only(tokenized: Path) -> None:
    report = _json(str(tokenized), "--limit", "0")
    assert [(g["reason"], g["count"]) for g in report["reasons"]] == [
        (g["reason"], g["count"]) for g in _truth(_rows(tokenized), 0)
    ]
    assert all(g["examples"] == [] for g in report["reasons"])


def test_stops_reading_parts_once_examples_are_found(tokenized: Path, tmp_path: Path) -> None:
    """malformed_json rows are all in part 0: a broken last part is never opened for them."""
    copy = tmp_path / "tok"
    shutil.copytree(tokenized, copy)
    parts = sorted((copy / ERRORS_DIR).glob("part-*.arrow"))
    assert len(parts) > 2 and all(r["reason"] != "malformed_json" for r in _rows(copy)[-3:])
    parts[-1].write_bytes(b"not arrow")
    assert _errors(str(copy), "--reason", "malformed_json").exit_code == 0
    result = _errors(str(copy))  # needs the last part for its examples
    assert result.exit_code == 1
    assert parts[-1].name in result.output


def test_unknown_reason_or_dataset_is_a_usage_error(tokenized: Path) -> None:
    result = _errors(str(tokenized), "--reason", "no_such_reason")
    assert result.exit_code == 2 and "--reason" in result.output
    result = _errors(str(tokenized), "--dataset", "nope")
    assert result.exit_code == 2 and "nope" in result.output and "chat" in result.output


def test_pack_output_lists_oversize_samples(tokenized: Path, packed: Path) -> None:
    samples = _rows(tokenized, SAMPLES_DIR)
    over = [r for r in samples if r["num_tokens"] > PACK_SIZE]
    assert over
    report = _json(str(packed), "--limit", str(len(samples)))
    assert report["stage"] == "pack"
    assert (report["oversize"], report["samples"], report["pack_size"]) == (len(over), len(samples), PACK_SIZE)
    assert {(e["sample_id"], e["num_tokens"]) for e in report["examples"]} == {
        (r["sample_id"], r["num_tokens"]) for r in over
    }
    result = _errors(str(packed), "--limit", "2")
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.splitlines()[1:] if not line.lstrip().startswith("...")]
    assert len(listed) == 2 and set(listed) <= {r["sample_id"] for r in over}
    assert f"{len(over) - 2} more" in result.output


def test_filters_on_a_pack_output_are_refused(packed: Path) -> None:
    result = _errors(str(packed), "--reason", "too_long")
    assert result.exit_code == 2 and "prep pack" in result.output


def test_not_an_output_dir(tmp_path: Path) -> None:
    result = _errors(str(tmp_path))
    assert result.exit_code == 2
    assert "manifest.json" in result.output and "prep tokenize" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_error_summary_for_failure_messages(tokenized: Path) -> None:
    truth = _truth(_rows(tokenized), 1)
    text = error_summary(tokenized, limit=3)
    lines = text.splitlines()
    assert str(sum(g["count"] for g in truth)) in lines[0] and f"prep errors {tokenized}" in lines[0]
    for group, line in zip(truth[:3], lines[1:4]):
        assert line.startswith(f"  {group['reason']} {group['count']}: e.g. {group['examples'][0]['sample_id']} ")
    assert len(lines) == 5 and all(f"{g['reason']} {g['count']}" in lines[4] for g in truth[3:])
    sharegpt_only = error_summary(tokenized, limit=1, datasets=("sharegpt_json",))
    assert "--dataset sharegpt_json" in sharegpt_only and "chat:" not in sharegpt_only
