"""The self-contained HTML report: inline CSS, tables, PNGs as base64 data URIs, no links."""

from __future__ import annotations

import base64
from html import escape

from prep.errors.core import ReasonGroup
from prep.stats.labels import FRACTIONS, PER_PACK_LABELS, format_number, pack_rows
from prep.stats.plots import Plot
from prep.stats.records import Distribution, GroupStats, PackStats, Stats

CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; }
figure { margin: 1.5em 0; }
img { max-width: 100%; }
"""
LENGTH_LABELS = (("num_tokens", "total"), ("num_text_tokens", "text"), ("num_media_tokens", "media"))
MESSAGE_CHARS = 300  # a longer error message is cut in the report; stats.json keeps it whole


def render_html(stats: Stats, plots: list[Plot], title: str, input_dir: str = "DIR") -> str:
    """The whole report as one string; same stats and plots give the same bytes.

    ``input_dir`` is the directory as the user named it, for the `prep errors` hints.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>Input written by stage <code>{escape(stats.stage.value)}</code>; histograms use up to {stats.bins}"
        " bins. The same numbers are in <code>stats.json</code>.</p>",
        *(f"<p><strong>Note:</strong> {escape(note)}</p>" for note in stats.notes),
    ]
    if stats.overall is not None:
        parts += ["<h2>Datasets</h2>", _datasets_table(stats), "<h2>Token lengths</h2>", _lengths_table(stats)]
    if stats.packs is not None:
        parts += ["<h2>Packs</h2>", _packs_table(stats.packs)]
        if stats.packs.oversize:
            parts += ["<h2>Oversize samples (dropped)</h2>", *_oversize(stats.packs, input_dir)]
    if stats.overall is not None and stats.overall.errors:
        parts += ["<h2>Errors by reason</h2>", _errors_table(stats)]
    if stats.error_examples:
        parts += ["<h2>Error examples</h2>", *_error_examples(stats.error_examples, stats, input_dir)]
    if plots:
        parts.append("<h2>Plots</h2>")
        parts += [_figure(p) for p in plots]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _figure(plot: Plot) -> str:
    """The plot alone: its title is drawn in the image (a caption only repeated it); ``alt`` keeps it."""
    data = base64.b64encode(plot.png).decode("ascii")
    image = f'<img src="data:image/png;base64,{data}" alt="{escape(plot.title)}">'
    return f'<figure id="{escape(plot.key)}">{image}</figure>'


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: object) -> str:
    """Numbers right-aligned (class ``num``), text (ids, reasons, messages) left-aligned."""
    numeric = isinstance(value, (int, float)) or (isinstance(value, str) and _looks_numeric(value))
    return f'<td class="num">{escape(_fmt(value))}</td>' if numeric else f"<td>{escape(_fmt(value))}</td>"


def _looks_numeric(text: str) -> bool:
    """Formatted numbers: ``1,234``, ``97.5%``, ``0.42``."""
    return bool(text) and text.replace(",", "").replace("%", "").replace(".", "", 1).lstrip("-").isdigit()


def _groups(stats: Stats) -> list[tuple[str, GroupStats]]:
    rows = list(stats.datasets.items())
    return rows + ([("all", stats.overall)] if stats.overall is not None else [])


def _datasets_table(stats: Stats) -> str:
    kinds = sorted({k for _, g in _groups(stats) for k in g.media_items})
    header = ["dataset", "samples", "errors", "with media", *(f"{k} items" for k in kinds)]
    header += ["tokens", "text tokens", "media tokens"]
    rows: list[list[object]] = []
    for name, g in _groups(stats):
        media = [g.media_items.get(k, 0) for k in kinds]
        totals = [g.lengths[c].total for c, _ in LENGTH_LABELS]
        rows.append([name, g.samples, g.errors, g.samples_with_media, *media, *totals])
    return _table(header, rows)


def _lengths_table(stats: Stats) -> str:
    header = ["dataset", "length", "mean", "min", "p50", "p90", "p99", "max"]
    rows: list[list[object]] = []
    for name, g in _groups(stats):
        for column, label in LENGTH_LABELS:
            d: Distribution = g.lengths[column]
            rows.append([name, label, d.mean, d.min, d.p50, d.p90, d.p99, d.max])
    return _table(header, rows)


def _packs_table(packs: PackStats) -> str:
    """Plan numbers under readable labels, then each per-pack distribution's summary."""
    rows: list[list[object]] = [[label, value] for group in pack_rows(packs) for label, value in group]
    for name, label in PER_PACK_LABELS:
        d = packs.per_pack[name]
        for field in ("mean", "p50", "p90", "p99", "max"):
            rows.append([f"{label}, {field}", format_number(getattr(d, field), name in FRACTIONS)])
    return _table(["quantity", "value"], rows)


def _errors_table(stats: Stats) -> str:
    names = list(stats.datasets)
    reasons = sorted(stats.overall.errors_by_reason) if stats.overall else []
    rows = [[r, *(stats.datasets[n].errors_by_reason.get(r, 0) for n in names), _total(stats, r)] for r in reasons]
    return _table(["reason", *names, "all"], rows)


def _error_examples(groups: tuple[ReasonGroup, ...], stats: Stats, input_dir: str) -> list[str]:
    """Per reason: its count, then its first rows with where they came from and why."""
    inputs = list(stats.packs.inputs) if stats.packs is not None else [input_dir]
    hint = " or ".join(f"<code>prep errors {escape(d)}</code>" for d in inputs)
    rows: list[list[object]] = []
    for group in groups:
        for i, e in enumerate(group.examples):
            count = f"{group.count:,}" if i == 0 else ""
            rows.append([group.reason if i == 0 else "", count, e.sample_id, f"{e.source}:{e.line}", _cut(e.message)])
    intro = (
        f"<p>The first rows of each reason, in part order (line = 0-based record index in its file). "
        f"Every row: {hint} (<code>--json</code> for whole messages).</p>"
    )
    return [intro, _table(["reason", "error rows", "sample id", "source:line", "message"], rows)]


def _oversize(packs: PackStats, input_dir: str) -> list[str]:
    """How many samples exceed the pack size and the first of them by id."""
    shown = len(packs.oversize_samples)
    more = f"; the first {shown:,} are listed" if shown < packs.oversize else ""
    intro = (
        f"<p>{packs.oversize:,} of {packs.num_samples:,} tokenized samples are longer than the pack size "
        f"({packs.pack_size:,} tokens) and are in no pack{more}. All of them: "
        f"<code>prep errors {escape(input_dir)}</code>.</p>"
    )
    rows: list[list[object]] = [[o.sample_id, o.num_tokens, o.input] for o in packs.oversize_samples]
    return [intro, _table(["sample id", "tokens", "tokenized input"], rows)]


def _cut(message: str) -> str:
    flat = " ".join(message.split())
    return flat if len(flat) <= MESSAGE_CHARS else flat[: MESSAGE_CHARS - 1] + "…"


def _total(stats: Stats, reason: str) -> int:
    return stats.overall.errors_by_reason.get(reason, 0) if stats.overall else 0


def _fmt(value: object) -> str:
    return format_number(value) if value is None or isinstance(value, (int, float)) else str(value)
