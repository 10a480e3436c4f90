"""Typed results of `prep stats` and their JSON form (``stats.json``).

Integer data get integer bin edges ``[lo, lo + w, ...]`` with ``w = ceil((max - min + 1) /
bins)``, so each bin holds whole token counts; when the top 1 % would stretch the range more
than `OVERFLOW_STRETCH` times (one 15k-token sample among 500-token ones), ``bins - 1`` bins
cover ``[min, p99]`` and one overflow bin holds the rest up to ``max``, so an outlier no longer
squeezes every sample into the first bins. Token lengths, which span orders of magnitude,
get `log_integer_edges` instead when ``max + 1 > OVERFLOW_STRETCH x (min + 1)``: integer edges
spaced evenly on a log axis (0 gets its own bin ``[0, 1)``), which the report draws on a log
axis, so a 15k-token sample and 50-token ones are all readable in one plot. Fractions (pack
fill) get ``bins`` equal bins over ``[0, 1]``. Percentiles are observed values
(``inverted_cdf``: the smallest value with at least q% of the data at or below it). Example,
lengths ``[3, 5, 5, 9]``, bins=3::

    edges [3, 6, 9, 12]   counts [3, 0, 1]   p50=5  p90=9  p99=9  max=9  total=22
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from prep.errors.core import OversizeExample, ReasonGroup
from schemas.codec import to_json
from schemas.stages import Stage

PERCENTILES = (50, 90, 99)
OVERFLOW_STRETCH = 4  # max - min over (p99 - min + 1) past which the tail goes into one overflow bin
Number = int | float


@dataclass(frozen=True, kw_only=True, slots=True)
class Histogram:
    """Bin ``i`` counts values in ``[edges[i], edges[i + 1])`` (the last bin is closed)."""

    edges: tuple[Number, ...]
    counts: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"bin_edges": list(self.edges), "counts": list(self.counts)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """Summary of one quantity; a field is None where the source gave only part of it.

    Attributes:
        count: Values summarised.
        total: Their sum.
        mean: total / count.
        min, p50, p90, p99, max: Order statistics (observed values).
        histogram: Binned counts, or None.
    """

    count: int
    total: Number | None = None
    mean: float | None = None
    min: Number | None = None
    p50: Number | None = None
    p90: Number | None = None
    p99: Number | None = None
    max: Number | None = None
    histogram: Histogram | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count}
        for name in ("total", "mean", "min", "p50", "p90", "p99", "max"):
            out[name] = getattr(self, name)
        out["histogram"] = self.histogram.to_json() if self.histogram else None
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupStats:
    """Statistics of one dataset (or of all datasets together).

    Attributes:
        samples: Sample rows.
        errors: Error rows.
        media_items: Media items of the samples by kind (``image``, ``video``).
        samples_with_media: Samples with at least one media item.
        lengths: Distribution per length column (``num_tokens``, ``num_text_tokens``,
            ``num_media_tokens``); one set of bin edges per column across all groups.
        errors_by_reason: Error rows by reason code.
    """

    samples: int
    errors: int
    media_items: dict[str, int]
    samples_with_media: int
    lengths: dict[str, Distribution]
    errors_by_reason: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "errors": self.errors,
            "media_items": dict(self.media_items),
            "samples_with_media": self.samples_with_media,
            "tokens": {
                "total": self.lengths["num_tokens"].total,
                "text": self.lengths["num_text_tokens"].total,
                "media": self.lengths["num_media_tokens"].total,
            },
            "lengths": {k: v.to_json() for k, v in self.lengths.items()},
            "errors_by_reason": dict(self.errors_by_reason),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class PackStats:
    """Pack numbers of a packed directory: plan-level counts from its ``PackManifest``,
    shard totals from its ``ShardsManifest`` and per-pack distributions from
    ``pack_stats.arrow``.

    Attributes:
        pack_size: Tokens per pack.
        num_packs: Packs in the plan.
        lb1: ceil(slot tokens / pack_size), a lower bound on ``num_packs``.
        lb2: Martello-Toth L2 lower bound on ``num_packs``.
        packs_over_lb2: ``num_packs - lb2``.
        efficiency: Real tokens / (packs x pack_size), a fraction.
        num_tokens: Real tokens in packs.
        pad_tokens: Slot rounding tokens (``pad_to_multiple_of``).
        empty_tokens: ``num_packs x pack_size - num_tokens``.
        num_samples: Tokenized samples over all inputs (= packed + oversize).
        packed_samples: Samples in packs.
        oversize: Samples longer than a pack, dropped.
        num_shards: Shards written from the plan; None while none are complete.
        shard_bytes: Their total size; None like ``num_shards``.
        per_pack: ``fill`` (fraction of pack_size), ``samples_per_pack``, ``media_per_pack``.
        oversize_samples: The first oversize samples of the manifest's list (id, tokens, input),
            so the report names what was dropped; ``prep errors DIR`` lists them all.
        inputs: The tokenized directories the plan read (where its error rows are).
    """

    pack_size: int
    num_packs: int
    lb1: int
    lb2: int
    packs_over_lb2: int
    efficiency: float
    num_tokens: int
    pad_tokens: int
    empty_tokens: int
    num_samples: int
    packed_samples: int
    oversize: int
    num_shards: int | None
    shard_bytes: int | None
    per_pack: dict[str, Distribution]
    oversize_samples: tuple[OversizeExample, ...] = ()
    inputs: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        nested = ("per_pack", "oversize_samples", "inputs")
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in nested}
        out["oversize_samples"] = to_json(self.oversize_samples)
        out["inputs"] = list(self.inputs)
        return {**out, **{k: v.to_json() for k, v in self.per_pack.items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class Stats:
    """Everything `prep stats` reports about one directory.

    Attributes:
        stage: Stage that wrote the input directory.
        bins: Requested histogram bins.
        datasets: Per-dataset statistics, by name; empty without token data.
        overall: All datasets together, or None without token data.
        packs: Pack statistics of a packed directory, else None.
        notes: Why a section is missing (e.g. a packed dir's tokenized input is gone).
        error_examples: Error rows by reason, most frequent first: the count and the first
            few rows (sample id, source file and line, message), in part order.
    """

    stage: Stage
    bins: int
    datasets: dict[str, GroupStats]
    overall: GroupStats | None
    packs: PackStats | None
    notes: tuple[str, ...] = ()
    error_examples: tuple[ReasonGroup, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "notes": list(self.notes),
            "error_examples": to_json(self.error_examples),
            "bins": self.bins,
            "datasets": {k: v.to_json() for k, v in self.datasets.items()},
            "overall": self.overall.to_json() if self.overall else None,
            "packs": self.packs.to_json() if self.packs else None,
        }


def integer_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """At most ``bins`` integer-width bins covering ``[min, max]``: equal ones, or equal ones up
    to p99 plus one overflow bin when a few outliers would stretch the range (module docstring)."""
    if values.size == 0:
        return np.array([0, 1], dtype=np.int64)
    lo, hi = int(values.min()), int(values.max())
    top = int(np.percentile(values, 99, method="inverted_cdf"))
    if bins >= 3 and hi - lo + 1 > OVERFLOW_STRETCH * (top - lo + 1):
        regular = _equal_edges(lo, top, bins - 1)
        return np.append(regular, hi + 1)
    return _equal_edges(lo, hi, bins)


def log_integer_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """At most ``bins`` integer bins of equal width on a log axis covering ``[min, max]``; a narrow
    range (``max + 1 <= OVERFLOW_STRETCH x (min + 1)``) keeps `integer_edges`' equal bins.

    Example: lengths 0..15,331 with bins=6 -> ``[0, 1, 7, 47, 325, 2231, 15332]`` (0 alone, then
    each bin about 6.9x the last).
    """
    if values.size == 0:
        return np.array([0, 1], dtype=np.int64)
    lo, hi = int(values.min()), int(values.max())
    if hi + 1 <= OVERFLOW_STRETCH * (lo + 1) or bins < 2:
        return integer_edges(values, bins)
    start, parts = max(lo, 1), bins - (lo == 0)
    edges = np.unique(np.round(np.geomspace(start, hi + 1, parts + 1)).astype(np.int64))
    return np.concatenate([[0], edges]) if lo == 0 else edges


def is_log_binned(edges: tuple[Number, ...]) -> bool:
    """Whether `log_integer_edges` chose log spacing (the plot then uses a log axis): bins of
    unequal width before the last one (equal bins, with or without an overflow bin, are linear)."""
    widths = {b - a for a, b in zip(edges[:-2], edges[1:-1])}
    return len(widths) > 1 and edges[-1] > OVERFLOW_STRETCH * (edges[0] + 1)


def _equal_edges(lo: int, hi: int, bins: int) -> np.ndarray:
    """At most ``bins`` equal integer-width bins covering ``[lo, hi]``."""
    width = max(1, -(-(hi - lo + 1) // bins))
    count = -(-(hi - lo + 1) // width)
    return lo + width * np.arange(count + 1, dtype=np.int64)


def overflow_start(edges: tuple[Number, ...]) -> Number | None:
    """Where the overflow bin of `integer_edges` starts (its last bin wider than the others), or None."""
    if len(edges) < 4:
        return None
    first, last = edges[1] - edges[0], edges[-1] - edges[-2]
    return edges[-2] if last > 2 * first else None


def integer_distribution(values: np.ndarray, bins: int) -> Distribution:
    """Whole-number data (counts, lengths): integer bins, so no bin splits a value."""
    return distribution(values, integer_edges(values, bins))


def fraction_edges(bins: int) -> np.ndarray:
    """``bins`` equal bins over [0, 1]."""
    return np.linspace(0.0, 1.0, bins + 1)


def distribution(values: np.ndarray, edges: np.ndarray) -> Distribution:
    """Full summary of ``values`` with a histogram over the given edges."""
    counts, _ = np.histogram(values, bins=edges)
    histogram = Histogram(edges=tuple(_py(e) for e in edges), counts=tuple(int(c) for c in counts))
    if values.size == 0:
        return Distribution(count=0, total=0, mean=0.0, histogram=histogram)
    p50, p90, p99 = (_py(v) for v in np.percentile(values, PERCENTILES, method="inverted_cdf"))
    total = _py(values.sum(dtype=np.float64 if values.dtype.kind == "f" else np.int64))
    return Distribution(
        count=int(values.size),
        total=total,
        mean=round(float(total) / values.size, 4),
        min=_py(values.min()),
        p50=p50,
        p90=p90,
        p99=p99,
        max=_py(values.max()),
        histogram=histogram,
    )


def _py(value: Any) -> Number:
    """A numpy scalar as a plain int or (rounded) float, for stable JSON."""
    if isinstance(value, (np.integer, int)):
        return int(value)
    return round(float(value), 6)
