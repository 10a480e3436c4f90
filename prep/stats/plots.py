"""PNG plots of a :class:`Stats`, drawn with matplotlib's Agg canvas (no pyplot, no display).

Token lengths are drawn on a log axis when their bins are log-spaced (`records.log_integer_edges`),
with a dashed line at the pack size (a packed dir's, or ``prep stats --pack-size``) and the
number of samples it cannot hold; the error bars leave room for their labels inside the frame.

Bytes are reproducible: matplotlib's default style (a user's matplotlibrc is ignored), a
fixed size and dpi, and PNG metadata without the software version.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from packvlm.optional import MissingPackageError, missing_package_message
from prep.stats.labels import FRACTIONS, PER_PACK_LABELS, format_number
from prep.stats.records import Distribution, GroupStats, PackStats, Stats, is_log_binned

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

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


class StatsDependencyError(MissingPackageError, ImportError):
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
        message = missing_package_message("matplotlib", purpose="`prep stats` plots", install="pip install matplotlib")
        raise StatsDependencyError(message) from exc


def render_plots(stats: Stats, pack_size: int | None = None) -> list[Plot]:
    """Every plot the data supports, in report order; missing data means no plot.

    Args:
        stats: What `collect_stats` found.
        pack_size: Tokens per pack to mark on the length plots; a packed dir's own wins.
    """
    plots = []
    overall = stats.overall
    marker = stats.packs.pack_size if stats.packs is not None else pack_size
    if overall is not None:
        for key, column, title in TOKEN_PLOTS:
            groups = {name: g.lengths[column] for name, g in stats.datasets.items()}
            paint = partial(_lengths, groups=groups, title=title, pack_size=marker if column == "num_tokens" else None)
            plots.append(Plot(key=key, title=title, png=_draw(paint)))
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
    fig = draw_figure(paint)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def draw_figure(paint: Callable[[Axes], None]) -> Figure:
    """A figure with ``paint(ax)`` done, in matplotlib's default style, laid out (tests read its artists)."""
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.style.context("default"):
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        paint(fig.add_subplot())
        fig.draw_without_rendering()  # constrained layout done: artists' extents are final
    return fig


def _lengths(ax: Axes, groups: dict[str, Distribution], title: str, pack_size: int | None = None) -> None:
    """One step histogram per dataset over the shared bin edges, on a log axis when the bins are
    log-spaced (0 sits left of 1 on a symlog axis); a dashed line marks the pack size."""
    log_axis, lowest, longest, tallest = False, None, 0, 1
    for name, dist in groups.items():
        hist = dist.histogram
        if hist is None or not dist.count:
            continue
        facts = ", ".join(f"{k}={format_number(getattr(dist, k))}" for k in ("p50", "p99", "max"))
        ax.stairs(hist.counts, hist.edges, label=f"{name} (n={dist.count:,}, {facts})", linewidth=1.6)
        log_axis = is_log_binned(hist.edges)
        lowest = hist.edges[0]
        longest = max(longest, int(dist.max or 0))
        tallest = max(tallest, *hist.counts)
    ax.set_ylim(0, tallest * 1.15)  # headroom: the pack-size label sits above the tallest bar
    if log_axis:
        if lowest == 0:
            ax.set_xscale("symlog", linthresh=1, linscale=0.4)
        else:
            ax.set_xscale("log")
        ax.set_xlim(lowest, None)  # nothing lies below the first edge (symlog would show negatives)
        ax.xaxis.set_major_formatter(_thousands())
    else:
        _integer_ticks(ax.xaxis)
    if pack_size is not None:
        ax.axvline(pack_size, color="0.25", linestyle="--", linewidth=1.2, zorder=3)
        over = "longest sample fits" if longest <= pack_size else f"longest {longest:,} does not fit"
        ax.annotate(
            f"pack size {pack_size:,} ({over})",
            (pack_size, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-4, -4),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize="small",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
        )
    scale = " (log axis)" if log_axis else ""
    ax.set_title(f"{title}, by dataset{scale}")
    ax.set_xlabel("tokens per sample" + scale)
    ax.set_ylabel("samples")
    _integer_ticks(ax.yaxis)
    if groups:  # below the axes: never over the bars or the pack-size label
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=min(len(groups), 2))


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{x:,.0f}")


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
    # room right of the longest bar for its count label and the legend (bars sorted: shortest at the bottom)
    ax.set_xlim(0, max(left, default=1) * 1.25 + 0.5)
    ax.legend(fontsize="small", loc="lower right")


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
