"""PNG plots of a :class:`Stats`, drawn with matplotlib's Agg canvas (no pyplot, no display).

Bytes are reproducible: matplotlib's default style (a user's matplotlibrc is ignored), a
fixed size and dpi, and PNG metadata without the software version.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from packvlm.errors import ResourceError
from prep.stats.labels import FRACTIONS, PER_PACK_LABELS, format_number
from prep.stats.records import Distribution, GroupStats, PackStats, Stats, overflow_start

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis

FIGSIZE = (8.0, 4.5)
DPI = 100
TOKEN_PLOTS = (
    ("tokens_text", "num_text_tokens", "Text tokens per sample"),
    ("tokens_media", "num_media_tokens", "Media tokens per sample"),
    ("tokens_total", "num_tokens", "Total tokens per sample"),
)
PACK_PLOTS = (
    ("pack_fill", "fill", "Pack fill"),
    ("pack_samples", "samples_per_pack", "Samples per pack"),
    ("pack_media", "media_per_pack", "Media items per pack"),
)


class StatsDependencyError(ResourceError, ImportError):
    """matplotlib, needed for the report's plots, is not installed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plot:
    """One rendered figure: ``key`` names it in the HTML (``id``) and in tests."""

    key: str
    title: str
    png: bytes


def require_matplotlib() -> None:
    """Fail early, before any data is read, if plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise StatsDependencyError("`prep stats` draws its plots with matplotlib: pip install matplotlib") from exc


def render_plots(stats: Stats) -> list[Plot]:
    """Every plot the data supports, in report order; missing data means no plot."""
    plots = []
    overall = stats.overall
    if overall is not None:
        for key, column, title in TOKEN_PLOTS:
            groups = {name: g.lengths[column] for name, g in stats.datasets.items()}
            plots.append(Plot(key=key, title=title, png=_draw(partial(_lengths, groups=groups, title=title))))
        if overall.errors:
            png = _draw(partial(_errors, datasets=stats.datasets, overall=overall))
            plots.append(Plot(key="errors_by_reason", title="Errors by reason", png=png))
    if stats.packs is not None:
        for key, name, title in PACK_PLOTS:
            dist = stats.packs.per_pack[name]
            if dist.count:
                png = _draw(partial(_pack, dist=dist, name=name, title=title, packs=stats.packs))
                plots.append(Plot(key=key, title=title, png=png))
    return plots


def _draw(paint: Callable[[Axes], None]) -> bytes:
    """Run ``paint(ax)`` on a fresh figure and return deterministic PNG bytes."""
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.style.context("default"):
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        paint(fig.add_subplot())
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _lengths(ax: Axes, groups: dict[str, Distribution], title: str) -> None:
    """One step histogram per dataset over the shared bin edges; an overflow bin (`overflow_start`)
    is drawn as wide as the others, shaded and labelled, so outliers do not stretch the axis."""
    overflow = None
    for name, dist in groups.items():
        hist = dist.histogram
        if hist is None:
            continue
        facts = ", ".join(f"{k}={format_number(getattr(dist, k))}" for k in ("p50", "p99", "max"))
        label = f"{name} (n={dist.count:,}, {facts})"
        edges = list(hist.edges)
        overflow = overflow_start(hist.edges)
        if overflow is not None:
            edges[-1] = edges[-2] + (edges[1] - edges[0])
        ax.stairs(hist.counts, edges, label=label, linewidth=1.6)
        shown = edges
    if overflow is not None:
        ax.axvspan(shown[-2], shown[-1], color="0.92", zorder=0)
        ax.text(
            (shown[-2] + shown[-1]) / 2,
            0.98,
            f"≥ {format_number(overflow)}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize="small",
        )
    ax.set_title(f"{title}, by dataset" + (" (shaded: the samples beyond p99)" if overflow is not None else ""))
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    _integer_ticks(ax.xaxis)
    _integer_ticks(ax.yaxis)
    if groups:
        ax.legend(fontsize="small")


def _errors(ax: Axes, datasets: dict[str, GroupStats], overall: GroupStats) -> None:
    """Horizontal bars per reason, stacked by dataset, most frequent reason on top."""
    reasons = sorted(overall.errors_by_reason.items(), key=lambda kv: (kv[1], kv[0]))
    names = [r for r, _ in reasons]
    left = [0] * len(names)
    for dataset, group in datasets.items():
        widths = [group.errors_by_reason.get(r, 0) for r in names]
        if any(widths):
            ax.barh(names, widths, left=left, label=dataset)
            left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.annotate(f"{total:,}", (total, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize="small")
    ax.set_title(f"Errors by reason ({overall.errors:,} error rows)")
    ax.set_xlabel("error rows")
    _integer_ticks(ax.xaxis)
    ax.margins(x=0.06)
    ax.legend(fontsize="small")


def _pack(ax: Axes, dist: Distribution, name: str, title: str, packs: PackStats) -> None:
    """A per-pack histogram; the fill plot's title carries packs, L2 bound and efficiency."""
    hist = dist.histogram
    if hist is None:
        return
    ax.stairs(hist.counts, hist.edges, fill=True, alpha=0.8)
    fraction = name in FRACTIONS
    facts = []
    if name == "fill":
        facts += [f"packs {packs.num_packs:,}", f"lower bound L2 {packs.lb2:,}"]
        facts.append(f"efficiency {format_number(packs.efficiency, fraction=True)}")
    facts += [f"{k} {format_number(getattr(dist, k), fraction)}" for k in ("mean", "p50", "max")]
    ax.set_title(f"{title} ({', '.join(facts)})", fontsize="medium")
    ax.set_xlabel(dict(PER_PACK_LABELS)[name])
    ax.set_ylabel("packs")
    if not fraction:
        _integer_ticks(ax.xaxis)
    _integer_ticks(ax.yaxis)


def _integer_ticks(axis: Axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))
