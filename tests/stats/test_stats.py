"""`prep stats` on real `prep tokenize` and `prep pack` outputs of the generated example.

Truths, read independently of the manifests the report is built from: the tokenized Arrow
parts row by row with plain pyarrow (counts, sums, extremes, media kinds, error reasons),
the shards' ``json`` members with the stdlib ``tarfile`` (packs, samples, media and tokens
per pack), the shard files on disk, and a second run (byte identity).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import shutil
import tarfile
from collections import Counter, defaultdict
from html import unescape
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from prep.cli import main
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR
from tests.stats.conftest import PACK_SIZE

pytest.importorskip("matplotlib")

BINS = 16
TOKEN_PLOTS = ["tokens_text", "tokens_media", "tokens_total"]
PACK_PLOTS = ["pack_fill", "pack_samples", "pack_media"]
IMG = re.compile(r'<figure id="(\w+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
LENGTHS = ("num_tokens", "num_text_tokens", "num_media_tokens")


def _stats(*args: str) -> str:
    result = CliRunner().invoke(main, ["stats", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


@pytest.fixture(scope="module")
def report(tokenized: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("report")
    return out, _stats(str(tokenized), "--output", str(out), "--bins", str(BINS))


@pytest.fixture(scope="module")
def pack_report(packed: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("pack_report")
    return out, _stats(str(packed), "--output", str(out), "--bins", str(BINS))


def _rows(root: Path, table: str) -> list[dict]:
    rows = []
    for part in sorted((root / table).glob("part-*.arrow")):
        with pa.OSFile(str(part), "rb") as source:
            rows.extend(pa.ipc.open_file(source).read_all().to_pylist())
    return rows


def _packs_in_shards(packed: Path) -> list[dict]:
    """Every pack's ``json`` member, read with tarfile from the shard files on disk."""
    metas = []
    for shard in sorted((packed / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    metas.append(json.loads(tar.extractfile(member).read()))  # type: ignore[union-attr]
    return metas


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
    assert overall["tokens"]["total"] == sum(r["num_tokens"] for r in samples)
    assert stats["stage"] == "tokenize" and stats["packs"] is None and stats["bins"] == BINS
    assert stats["notes"] == []


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
    assert all(isinstance(e, int) for e in edges)
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
    samples, errors = _rows(tokenized, SAMPLES_DIR), _rows(tokenized, ERRORS_DIR)
    assert f"{len(samples):,} samples, {len(errors):,} errors" in output


def test_second_run_is_byte_identical(report, tokenized):
    out, _ = report
    _stats(str(tokenized), "--bins", str(BINS))  # default output: DIR/stats
    for name in ("stats.json", "report.html"):
        assert (tokenized / "stats" / name).read_bytes() == (out / name).read_bytes()


def test_pack_numbers_equal_the_shards_and_parts(packed, tokenized, pack_report):
    """Plan numbers and per-pack distributions against the shards' json members and the parts."""
    out, _ = pack_report
    stats = json.loads((out / "stats.json").read_text())
    got = stats["packs"]
    metas = _packs_in_shards(packed)
    lengths = [r["num_tokens"] for r in _rows(tokenized, SAMPLES_DIR)]
    fitting = [n for n in lengths if n <= PACK_SIZE]
    tokens = [m["num_tokens"] for m in metas]
    assert got["num_packs"] == len(metas) > 1
    assert got["num_samples"] == len(lengths)
    assert got["packed_samples"] == sum(len(m["samples"]) for m in metas) == len(fitting)
    assert got["oversize"] == len(lengths) - len(fitting)
    assert got["num_tokens"] == sum(tokens) == sum(fitting)
    assert got["pack_size"] == PACK_SIZE
    assert got["lb1"] == math.ceil(sum(fitting) / PACK_SIZE)
    assert got["lb1"] <= got["lb2"] <= got["num_packs"]
    assert got["empty_tokens"] == len(metas) * PACK_SIZE - sum(tokens)
    assert got["efficiency"] == pytest.approx(sum(tokens) / (len(metas) * PACK_SIZE), abs=1e-6)
    shard_files = sorted((packed / "shards").glob("*.tar"))
    assert got["num_shards"] == len(shard_files) > 1
    assert got["shard_bytes"] == sum(p.stat().st_size for p in shard_files)

    samples_per_pack = [len(m["samples"]) for m in metas]
    media_per_pack = [len(m["media"]) for m in metas]
    for key, values in (("samples_per_pack", samples_per_pack), ("media_per_pack", media_per_pack)):
        dist = got[key]
        assert (dist["count"], dist["total"]) == (len(values), sum(values))
        assert (dist["min"], dist["max"]) == (min(values), max(values))
        _check_percentiles(values, dist)
        edges = dist["histogram"]["bin_edges"]
        assert all(isinstance(e, int) for e in edges), "integer data gets integer bins"
        assert sum(dist["histogram"]["counts"]) == len(values)
    fill = got["fill"]
    assert (fill["min"], fill["max"]) == pytest.approx((min(tokens) / PACK_SIZE, max(tokens) / PACK_SIZE), abs=1e-6)
    assert fill["histogram"]["bin_edges"][0] == 0.0 and fill["histogram"]["bin_edges"][-1] == 1.0
    assert sum(fill["histogram"]["counts"]) == len(metas)
    # token statistics come from the tokenized input the manifest pins
    assert stats["overall"]["tokens"]["total"] == sum(lengths)
    assert stats["stage"] == "pack" and stats["notes"] == []


def test_pack_report_uses_labels_and_percentages(pack_report, packed):
    out, output = pack_report
    html = (out / "report.html").read_text()
    efficiency = sum(m["num_tokens"] for m in _packs_in_shards(packed)) / (
        json.loads((out / "stats.json").read_text())["packs"]["num_packs"] * PACK_SIZE
    )
    percent = f"{efficiency:.2%}"
    for text in (html, output):
        assert "lower bound L1 (packs)" in text and "empty tokens (unused capacity)" in text
        assert f"efficiency (real tokens / pack capacity) {percent}" in re.sub(r"</td><td[^>]*>", " ", text)
    assert not re.search(r"<td[^>]*>(lb1|lb2|empty_tokens|efficiency)</td>", html)
    assert list(_plots(html)) == [*TOKEN_PLOTS, "errors_by_reason", *PACK_PLOTS]


def test_packed_dir_without_shards_or_inputs_reports_what_it_has(packed, tmp_path):
    """No shards.json and a tokenized input gone: pack numbers stay, two notes say what is missing."""
    from schemas.manifest import PackManifest, read_manifest

    copy = tmp_path / "packed"
    shutil.copytree(packed, copy, ignore=shutil.ignore_patterns("stats"))
    (copy / "shards.json").unlink()
    manifest = read_manifest(copy / MANIFEST_FILE, PackManifest)
    gone = [dataclasses.replace(i, path=str(tmp_path / "moved")) for i in manifest.inputs]
    moved = dataclasses.replace(manifest, inputs=tuple(gone))
    (copy / MANIFEST_FILE).write_text(json.dumps(moved.to_json()))
    output = _stats(str(copy), "--output", str(tmp_path / "r"))
    stats = json.loads((tmp_path / "r" / "stats.json").read_text())
    assert stats["overall"] is None and stats["datasets"] == {}
    assert (stats["packs"]["num_shards"], stats["packs"]["num_packs"]) == (None, manifest.packs.packs)
    assert len(stats["notes"]) == 2 and "shards.json" in stats["notes"][0] and "moved" in stats["notes"][1]
    assert "note: token statistics skipped" in output
    assert list(_plots((tmp_path / "r" / "report.html").read_text())) == PACK_PLOTS


def test_pack_stats_that_disagree_with_the_manifest_are_refused(packed, tmp_path):
    copy = tmp_path / "packed"
    shutil.copytree(packed, copy, ignore=shutil.ignore_patterns("stats"))
    with pa.OSFile(str(copy / "pack_stats.arrow"), "rb") as source:
        table = pa.ipc.open_file(source).read_all()
    with pa.OSFile(str(copy / "pack_stats.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table.slice(1))
    result = CliRunner().invoke(main, ["stats", str(copy)])
    assert result.exit_code == 2
    assert "pack_stats.arrow" in result.output and "rerun `prep pack`" in result.output


def test_directory_without_manifest_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["stats", str(tmp_path)])
    assert result.exit_code == 2
    assert "manifest.json" in result.output


def test_other_stage_manifest_is_a_usage_error(tokenized, tmp_path):
    raw = json.loads((tokenized / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**raw, "stage": "shards"}))
    result = CliRunner().invoke(main, ["stats", str(tmp_path)])
    assert result.exit_code == 2
    assert "written by `prep shards`" in result.output


def _section(html: str, heading: str) -> str:
    """The HTML between ``<h2>heading</h2>`` and the next heading."""
    start = html.index(f"<h2>{heading}</h2>")
    end = html.find("<h2>", start + 1)
    return html[start : end if end > 0 else len(html)]


def _cells(section: str) -> list[list[str]]:
    """Table body rows as lists of unescaped cell texts."""
    body = section[section.index("<tbody>") :]
    cells = (re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body))
    return [[unescape(c) for c in row] for row in cells]


def test_report_shows_error_examples_per_reason(report, tokenized):
    """Each reason's count and its first rows (id, file:line, message) as the errors parts hold them."""
    out, _ = report
    errors = _rows(tokenized, ERRORS_DIR)  # part order = the order `prep errors` shows
    by_reason: dict[str, list[dict]] = defaultdict(list)
    for row in errors:
        by_reason[row["reason"]].append(row)
    assert len(by_reason) > 1, "the example has several kinds of bad rows"
    cells = _cells(_section((out / "report.html").read_text(), "Error examples"))
    shown: dict[str, list[list[str]]] = defaultdict(list)
    reason = ""
    for row in cells:
        reason = row[0] or reason
        shown[reason].append(row)
    assert set(shown) == set(by_reason)
    for name, rows in by_reason.items():
        got = shown[name]
        assert got[0][1] == f"{len(rows):,}"
        assert len(got) == min(3, len(rows))
        for cell, row in zip(got, rows):
            assert cell[2] == row["sample_id"] and cell[3] == f"{row['source']}:{row['line']}"
            assert cell[4].startswith(" ".join(row["message"].split())[:100])
    assert f"prep errors {tokenized}" in unescape((out / "report.html").read_text())
    stats = json.loads((out / "stats.json").read_text())
    assert {g["reason"]: g["count"] for g in stats["error_examples"]} == {r: len(v) for r, v in by_reason.items()}
    for group in stats["error_examples"]:
        want = by_reason[group["reason"]][:3]
        assert [e["sample_id"] for e in group["examples"]] == [r["sample_id"] for r in want]
        assert [e["message"] for e in group["examples"]] == [r["message"] for r in want]


def test_pack_report_names_the_oversize_samples(pack_report, packed, tokenized):
    """The samples longer than the pack size, by id and length, as the tokenized parts hold them."""
    out, _ = pack_report
    too_long = {r["sample_id"]: r["num_tokens"] for r in _rows(tokenized, SAMPLES_DIR) if r["num_tokens"] > PACK_SIZE}
    assert too_long, "the example has a sample longer than 4096 tokens"
    html = (out / "report.html").read_text()
    section = _section(html, "Oversize samples (dropped)")
    rows = _cells(section)
    assert {r[0]: r[1] for r in rows} == {k: f"{v:,}" for k, v in too_long.items()}
    assert all(r[2] == str(tokenized) for r in rows)
    assert f"{len(too_long):,} of " in section and f"prep errors {packed}" in unescape(section)
    stats = json.loads((out / "stats.json").read_text())
    assert {o["sample_id"] for o in stats["packs"]["oversize_samples"]} == set(too_long)
    # error rows of the pinned tokenized input are shown for a packed dir too
    assert "<h2>Error examples</h2>" in html and f"prep errors {tokenized}" in unescape(html)


def test_one_long_outlier_gets_an_overflow_bin_instead_of_squashing_the_histogram():
    from functools import partial

    import numpy as np

    from prep.stats.plots import _draw, _lengths
    from prep.stats.records import distribution, integer_edges, overflow_start

    rng = np.random.default_rng(0)
    lengths = np.append(rng.integers(300, 600, size=400), 15_000)  # one 15k-token sample
    dist = distribution(lengths, integer_edges(lengths, BINS))
    hist = dist.histogram
    assert hist is not None and sum(hist.counts) == lengths.size and hist.edges[-1] > 15_000
    start = overflow_start(hist.edges)
    assert start is not None and start <= 600 and hist.counts[-1] == int((lengths >= start).sum())
    assert max(hist.counts) < 0.25 * lengths.size, hist.counts  # spread over the bins, not in the first one
    even = np.arange(100, 400)  # no outlier: equal bins, no overflow bin
    assert overflow_start(distribution(even, integer_edges(even, BINS)).histogram.edges) is None
    assert _draw(partial(_lengths, groups={"d": dist}, title="Total tokens per sample")).startswith(b"\x89PNG")


def test_report_has_no_repeated_captions_and_left_aligned_text(report):
    out, _ = report
    html = (out / "report.html").read_text()
    assert "<figcaption>" not in html  # the title is drawn in each plot already
    assert "td.num { text-align: right; }" in html and "text-align: left" in html
    section = _section(html, "Error examples")
    rows = re.findall(r"<tr>(.*?)</tr>", section[section.index("<tbody>") :])
    messages = [re.findall(r"<td[^>]*>", row)[-1] for row in rows]
    assert messages and set(messages) == {"<td>"}  # the message column is text: left-aligned
    assert re.search(r'<td class="num">\d', section)  # counts stay right-aligned
