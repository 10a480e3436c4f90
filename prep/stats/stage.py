"""`prep stats` stage: a tokenized or packed directory -> ``stats.json`` + ``report.html``.

Inputs: ``DIR/manifest.json`` (stage ``tokenize`` or ``pack``), the tokenized parts
(columns read memory-mapped, see :mod:`prep.stats.read`) and any pack statistics.
Outputs, in ``--output`` (default ``DIR/stats``): ``stats.json`` (sorted keys) and
``report.html`` (self-contained, plots as base64 PNGs). Invariants: nothing in ``DIR`` is
modified besides the default output folder; the same input and config give byte-identical
files. Example ``stats.json`` (abridged)::

    {"bins": 50, "stage": "tokenize", "packs": null,
     "datasets": {"chat": {"samples": 48, "errors": 14, "media_items": {"image": 40},
                           "tokens": {"total": 30112, "text": 2011, "media": 28101},
                           "lengths": {"num_tokens": {"count": 48, "p50": 310, "p99": 15331,
                                                      "max": 15331, "histogram": {...}}, ...},
                           "errors_by_reason": {"corrupt_image": 3, ...}}},
     "overall": {...}}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prep.stats.collect import collect_stats
from prep.stats.html import render_html
from prep.stats.plots import render_plots, require_matplotlib
from prep.stats.read import read_input
from prep.stats.records import Stats
from schemas.layout import TMP_PREFIX
from schemas.manifest import write_json_atomic

STATS_DIR = "stats"
STATS_JSON = "stats.json"
REPORT_HTML = "report.html"
DEFAULT_BINS = 50


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsConfig:
    """Every option of `prep stats`.

    Attributes:
        input_dir: Output directory of `prep tokenize` or `prep pack`.
        output_dir: Where the report goes; None means ``input_dir/stats``.
        bins: Most bins per histogram.
    """

    input_dir: str
    output_dir: str | None = None
    bins: int = DEFAULT_BINS

    def output_path(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path(self.input_dir) / STATS_DIR


def run_stats(config: StatsConfig) -> Stats:
    """Read, summarise, plot and write both files; returns the statistics."""
    if config.bins < 1:
        raise ValueError(f"bins must be >= 1, got {config.bins}")
    require_matplotlib()
    stats = collect_stats(read_input(config.input_dir), config.bins)
    plots = render_plots(stats)
    out = config.output_path()
    out.mkdir(parents=True, exist_ok=True)
    title = f"packvlm stats: {Path(config.input_dir).resolve().name}"
    _write_text_atomic(out / REPORT_HTML, render_html(stats, plots, title))
    write_json_atomic(out / STATS_JSON, stats.to_json())
    return stats


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def format_summary(stats: Stats, out: Path) -> str:
    """Short end-of-run report for the terminal."""
    lines = []
    if stats.overall is not None:
        g = stats.overall
        tokens = g.lengths["num_tokens"]
        lines.append(
            f"{len(stats.datasets)} datasets: {g.samples:,} samples, {g.errors:,} errors;"
            f" tokens {tokens.total:,} (text {g.lengths['num_text_tokens'].total:,},"
            f" media {g.lengths['num_media_tokens'].total:,}); sample length p50 {tokens.p50}, p99 {tokens.p99},"
            f" max {tokens.max}"
        )
    if stats.packs is not None:
        found = ", ".join(f"{k} {v}" for k, v in sorted(stats.packs.scalars.items())) or "no plan numbers"
        lines.append(f"packs: {found}; per-pack plots: {', '.join(sorted(stats.packs.per_pack)) or 'none'}")
    lines.append(f"wrote {out / STATS_JSON} and {out / REPORT_HTML}")
    return "\n".join(lines)
