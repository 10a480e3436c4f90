"""`prep stats` stage: a tokenized or packed directory -> ``stats.json`` + ``report.html``.

Inputs: ``DIR/manifest.json`` (a `TokenizeManifest` or `PackManifest`), the tokenized
parts it counts (columns read memory-mapped, see :mod:`prep.stats.read`) and, for a packed
dir, ``pack_stats.arrow`` and ``shards.json``.
Outputs, in ``--output`` (default ``DIR/stats``): ``stats.json`` (sorted keys) and
``report.html`` (self-contained, plots as base64 PNGs). Invariants: nothing in ``DIR`` is
modified besides the default output folder; the same input and config give byte-identical
files. Example ``stats.json`` (abridged)::

    {"bins": 50, "stage": "tokenize", "packs": null, "notes": [],
     "datasets": {"chat": {"samples": 48, "errors": 14, "media_items": {"image": 40},
                           "tokens": {"total": 30112, "text": 2011, "media": 28101},
                           "lengths": {"num_tokens": {"count": 48, "p50": 310, "p99": 15331,
                                                      "max": 15331, "histogram": {...}}, ...},
                           "errors_by_reason": {"corrupt_image": 3, ...}}},
     "overall": {...}}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packvlm.atomic import write_bytes_atomic, write_json_atomic
from prep.stats.collect import collect_stats
from prep.stats.html import render_html
from prep.stats.labels import format_number, pack_rows
from prep.stats.plots import render_plots, require_matplotlib
from prep.stats.read import read_input
from prep.stats.records import Stats

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
        pack_size: Tokens per pack to mark on the sample-length plot of a tokenized dir (a
            packed dir marks its own); None: no marker.
    """

    input_dir: str
    output_dir: str | None = None
    bins: int = DEFAULT_BINS
    pack_size: int | None = None

    def output_path(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path(self.input_dir) / STATS_DIR


def run_stats(config: StatsConfig) -> Stats:
    """Read, summarise, plot and write both files; returns the statistics."""
    if config.bins < 1:
        raise ValueError(f"bins must be >= 1, got {config.bins}")
    require_matplotlib()
    stats = collect_stats(read_input(config.input_dir), config.bins)
    plots = render_plots(stats, pack_size=config.pack_size)
    out = config.output_path()
    out.mkdir(parents=True, exist_ok=True)
    title = f"packvlm stats: {Path(config.input_dir).resolve().name}"
    write_bytes_atomic(out / REPORT_HTML, render_html(stats, plots, title, config.input_dir).encode("utf-8"))
    write_json_atomic(out / STATS_JSON, stats.to_json())
    return stats


def format_summary(stats: Stats, out: Path) -> str:
    """Short end-of-run report for the terminal."""
    lines = []
    if stats.overall is not None:
        g = stats.overall
        tokens = g.lengths["num_tokens"]
        lines.append(
            f"{len(stats.datasets)} datasets: {g.samples:,} samples, {g.errors:,} errors;"
            f" tokens {tokens.total:,} (text {g.lengths['num_text_tokens'].total:,},"
            f" media {g.lengths['num_media_tokens'].total:,}); sample length p50 {format_number(tokens.p50)},"
            f" p99 {format_number(tokens.p99)}, max {format_number(tokens.max)}"
        )
    if stats.packs is not None:
        lines += ["; ".join(f"{label} {value}" for label, value in group) for group in pack_rows(stats.packs)]
    lines += [f"note: {note}" for note in stats.notes]
    lines.append(f"wrote {out / STATS_JSON} and {out / REPORT_HTML}")
    return "\n".join(lines)
