"""`prep stats` on a real tokenized run of the generated example and on synthetic pack output.

Truths: the Arrow parts read row by row with plain pyarrow (counts, sums, extremes, media
kinds, error reasons), the tokenize manifest's totals, and a second run (byte identity).
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR
from schemas.manifest import build_manifest, write_json_atomic

pytest.importorskip("matplotlib")

BINS = 16
TOKEN_PLOTS = ["tokens_text", "tokens_media", "tokens_total"]
PACK_PLOTS = ["pack_fill", "pack_samples", "pack_media"]
IMG = re.compile(r'<figure id="(\w+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
LENGTHS = ("num_tokens", "num_text_tokens", "num_media_tokens")


@pytest.fixture(scope="module")
def tokenized(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stats") / "tok"
    config = TokenizeConfig(
        dataset_config=str(example_dir / "dataset_info.json"),
        processor=str(example_dir / "processor"),
        output_dir=str(out),
        executor="local",
        verify_fraction=0.0,
        rows_per_chunk=8,
    )
    run_tokenize(config)
    return out


def _stats(*args: str) -> str:
    result = CliRunner().invoke(main, ["stats", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


@pytest.fixture(scope="module")
def report(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("report")
    return out, _stats(str(tokenized), "--output", str(out), "--bins", str(BINS))


def _rows(root: Path, table: str) -> list[dict]:
    rows = []
    for part in sorted((root / table).glob("part-*.arrow")):
        with pa.OSFile(str(part), "rb") as source:
            rows.extend(pa.ipc.open_file(source).read_all().to_pylist())
    return rows


def _plots(html: str) -> dict[str, bytes]:
    return {key: base64.b64decode(data) for key, data in IMG.findall(html)}


def test_stats_json_equals_the_arrow_parts(tokenized, report):
    out, _ = report
    stats = json.loads((out / "stats.json").read_text())
    samples, errors = _rows(tokenized, SAMPLES_DIR), _rows(tokenized, ERRORS_DIR)
    by_dataset: dict[str, list[dict]] = defaultdict(list)
    for row in samples:
        by_dataset[row["dataset"]].append(row)
    error_datasets = {row["dataset"] for row in errors}
    assert sorted(stats["datasets"]) == sorted(set(by_dataset) | error_datasets)
    for name, got in stats["datasets"].items():
        rows = by_dataset[name]
        assert got["samples"] == len(rows)
        assert got["errors"] == sum(e["dataset"] == name for e in errors)
        assert got["errors_by_reason"] == dict(Counter(e["reason"] for e in errors if e["dataset"] == name))
        assert got["media_items"] == dict(Counter(m["kind"] for r in rows for m in r["media"]))
        assert got["samples_with_media"] == sum(bool(r["media"]) for r in rows)
        for column in LENGTHS:
            values = [r[column] for r in rows]
            dist = got["lengths"][column]
            assert (dist["count"], dist["total"]) == (len(values), sum(values))
            assert (dist["min"], dist["max"]) == (min(values), max(values))
            _check_percentiles(values, dist)
            _check_histogram(values, dist["histogram"], stats["datasets"], column)
        assert got["tokens"] == {
            "total": sum(r["num_tokens"] for r in rows),
            "text": sum(r["num_text_tokens"] for r in rows),
            "media": sum(r["num_media_tokens"] for r in rows),
        }
    overall = stats["overall"]
    assert overall["errors_by_reason"] == dict(Counter(e["reason"] for e in errors))
    assert (overall["samples"], overall["errors"]) == (len(samples), len(errors))
    manifest = json.loads((tokenized / MANIFEST_FILE).read_text())
    assert overall["tokens"] == {k: manifest["tokens"][k] for k in ("total", "text", "media")}
    assert overall["lengths"]["num_tokens"]["max"] == manifest["tokens"]["max_sample"]
    assert stats["stage"] == "tokenize" and stats["packs"] is None and stats["bins"] == BINS


def _check_percentiles(values: list[int], dist: dict) -> None:
    """Each pXX is an observed value with >= XX% of values at or below it and < XX% below."""
    for q in (50, 90, 99):
        p = dist[f"p{q}"]
        assert p in values
        assert sum(v <= p for v in values) >= q / 100 * len(values) > sum(v < p for v in values)


def _check_histogram(values: list[int], hist: dict, datasets: dict, column: str) -> None:
    edges, counts = hist["bin_edges"], hist["counts"]
    assert len(edges) == len(counts) + 1 <= BINS + 1
    assert sum(counts) == len(values)
    assert edges[0] <= min(values) and max(values) < edges[-1]
    assert all(d["lengths"][column]["histogram"]["bin_edges"] == edges for d in datasets.values())


def test_report_embeds_one_png_per_plot(report, tokenized):
    out, output = report
    html = (out / "report.html").read_text()
    plots = _plots(html)
    assert list(plots) == [*TOKEN_PLOTS, "errors_by_reason"]
    assert html.count("<img ") == len(plots)
    assert not re.search(r'(src|href)="(?!data:)', html)
    for png in plots.values():
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
        assert b"Software" not in png and b"matplotlib" not in png.lower()
    manifest = json.loads((tokenized / MANIFEST_FILE).read_text())
    assert f"{manifest['rows']['samples']:,} samples, {manifest['rows']['errors']:,} errors" in output


def test_second_run_is_byte_identical(report, tokenized):
    out, _ = report
    _stats(str(tokenized), "--bins", str(BINS))  # default output: DIR/stats
    for name in ("stats.json", "report.html"):
        assert (tokenized / "stats" / name).read_bytes() == (out / name).read_bytes()


def _pack_dir(root: Path, **sections: object) -> Path:
    root.mkdir()
    write_json_atomic(root / MANIFEST_FILE, build_manifest("pack", {"pack_size": 1000}, **sections))
    return root


def test_pack_manifest_renders_pack_plots_and_input_tokens(tmp_path, tokenized):
    """The manifest shape `prep pack` writes: a ``packs`` section, range-labelled fill."""
    packs = {
        "packs": 4, "lb2": 4, "efficiency": 0.975, "pack_size": 1000, "tokens": 3900,
        "fill_histogram": {"0.0-0.5": 1, "0.5-1.0": 3},
        "samples_per_pack": {"1": 1, "2": 2, "3": 1},
        "media_per_pack": {"0": 1, "2": 2, "3": 1},
    }  # fmt: skip
    packed = _pack_dir(
        tmp_path / "packed",
        inputs=[{"path": str(tokenized), "samples": 66}],
        samples={"total": 9, "packed": 8, "oversize": 1},
        packs=packs,
    )
    output = _stats(str(packed), "--output", str(tmp_path / "r"))
    stats = json.loads((tmp_path / "r" / "stats.json").read_text())
    got = stats["packs"]
    assert {k: got[k] for k in ("num_packs", "lb2", "efficiency", "pack_size", "num_tokens", "oversize")} == {
        "num_packs": 4, "lb2": 4, "efficiency": 0.975, "pack_size": 1000, "num_tokens": 3900, "oversize": 1,
    }  # fmt: skip
    assert got["fill"]["histogram"] == {"bin_edges": [0.0, 0.5, 1.0], "counts": [1, 3]}
    assert (got["samples_per_pack"]["total"], got["samples_per_pack"]["max"]) == (8, 3)
    assert (got["media_per_pack"]["count"], got["media_per_pack"]["total"]) == (4, 7)
    assert stats["overall"]["samples"] == len(_rows(tokenized, SAMPLES_DIR))
    plots = list(_plots((tmp_path / "r" / "report.html").read_text()))
    assert plots == [*TOKEN_PLOTS, "errors_by_reason", *PACK_PLOTS]
    assert "num_packs 4" in output


def test_pack_stats_arrow_and_other_forms(tmp_path):
    """Per-pack Arrow columns win; an edges/counts histogram and a value list also work."""
    packed = _pack_dir(
        tmp_path / "packed",
        num_packs=3,
        fill_histogram={"edges": [0.0, 0.5, 1.0], "counts": [0, 9]},
        media_per_pack=[0, 2, 1],
    )
    per_pack = pa.table({"num_tokens": [1000, 950, 400], "num_samples": [2, 5, 1]})
    with pa.OSFile(str(packed / "pack_stats.arrow"), "wb") as sink, pa.ipc.new_file(sink, per_pack.schema) as w:
        w.write_table(per_pack)
    _stats(str(packed), "--output", str(tmp_path / "r"), "--bins", "4")
    stats = json.loads((tmp_path / "r" / "stats.json").read_text())
    fill = stats["packs"]["fill"]
    assert (fill["min"], fill["max"], fill["histogram"]["counts"]) == (0.4, 1.0, [0, 1, 0, 2])
    assert stats["packs"]["samples_per_pack"]["total"] == 8
    assert stats["packs"]["media_per_pack"]["total"] == 3
    assert stats["overall"] is None and stats["datasets"] == {}
    assert list(_plots((tmp_path / "r" / "report.html").read_text())) == PACK_PLOTS


def test_pack_manifest_without_pack_numbers_skips_pack_plots(tmp_path):
    packed = _pack_dir(tmp_path / "bare", packs="not a section", fill_histogram={"edges": "?"})
    _stats(str(packed), "--output", str(tmp_path / "r"))
    stats = json.loads((tmp_path / "r" / "stats.json").read_text())
    assert stats["packs"] == {"pack_size": 1000}
    assert _plots((tmp_path / "r" / "report.html").read_text()) == {}


def test_directory_without_manifest_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["stats", str(tmp_path)])
    assert result.exit_code == 2
    assert "manifest.json" in result.output
