"""Pure pack statistics from whatever a packed directory records, read defensively.

Sources, first match wins: ``pack_stats.arrow`` columns (one row per pack), then
``pack_stats.json``, then ``manifest.json``. Within a JSON document a key is looked up at
the top level, then in the sections ``packs``, ``pack``, ``stats``, ``plan``, ``summary``,
``config``. A per-pack quantity may be given as

- a list of per-pack values: ``[0.98, 1.0, 0.91]`` -> full distribution;
- a value -> count mapping: ``{"1": 10, "2": 30}`` -> full distribution;
- a histogram: ``{"edges": [0, 0.5, 1], "counts": [1, 9]}`` (also ``bin_edges``/``bins``
  and ``bin_counts``), optionally with ``mean``/``p50``/``max``... -> those numbers;
- range labels, as `prep pack` writes its fill: ``{"0.0-0.5": 1, "0.5-1.0": 9}``;
- summary numbers only: ``{"mean": 3.2, "max": 7}`` -> no plot.

Anything else, or a missing key, is skipped: the report then lacks that plot, never fails.
Per-pack token counts (``num_tokens`` column) become fill fractions when ``pack_size`` is
known.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa

from prep.stats.read import PackSource
from prep.stats.records import (
    Distribution,
    Histogram,
    Number,
    PackStats,
    distribution,
    fraction_edges,
    integer_edges,
)

SECTIONS = ("packs", "pack", "stats", "plan", "summary", "config")
# Output name -> keys to try; a dotted key walks into nested objects.
SCALARS: dict[str, tuple[str, ...]] = {
    "num_packs": ("num_packs", "packs"),
    "num_samples": ("num_samples", "samples.total"),
    "packed_samples": ("packed_samples", "samples.packed"),
    "oversize": ("num_oversize", "oversize", "samples.oversize"),
    "pack_size": ("pack_size",),
    "lb1": ("lb1", "lower_bound_l1"),
    "lb2": ("lb2", "lower_bound_l2"),
    "packs_over_lb2": ("packs_over_lb2",),
    "efficiency": ("efficiency",),
    "num_tokens": ("num_tokens", "tokens"),
    "slot_tokens": ("slot_tokens",),
    "pad_tokens": ("pad_tokens",),
    "empty_tokens": ("empty_tokens",),
}
PER_PACK_JSON: dict[str, tuple[str, ...]] = {
    "fill": ("fill_histogram", "fill", "pack_fill"),
    "samples_per_pack": ("samples_per_pack", "pack_samples", "num_samples_per_pack"),
    "media_per_pack": ("media_per_pack", "pack_media", "num_media_per_pack"),
}
PER_PACK_COLUMNS: dict[str, tuple[str, ...]] = {
    "fill": ("fill",),
    "samples_per_pack": ("num_samples", "samples"),
    "media_per_pack": ("num_media", "media"),
}
TOKENS_COLUMNS = ("num_tokens", "tokens")
RANGE_LABEL = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*-\s*([0-9]*\.?[0-9]+)\s*$")
SUMMARY_KEYS = ("count", "total", "mean", "min", "p50", "p90", "p99", "max")


def collect_packs(source: PackSource, bins: int) -> PackStats:
    """Plan-level numbers and per-pack distributions found in ``source``."""
    documents = [d for d in (source.extra, source.manifest) if d is not None]
    scalars: dict[str, Number] = {}
    for name, keys in SCALARS.items():
        value = _find(documents, keys, _is_number)
        if value is not None:
            scalars[name] = value
    per_pack: dict[str, Distribution] = {}
    columns = _per_pack_columns(source.per_pack, scalars.get("pack_size"))
    for name, keys in PER_PACK_JSON.items():
        if name in columns:
            per_pack[name] = _from_values(columns[name], bins, fraction=name == "fill")
            continue
        raw = _find(documents, keys, lambda v: isinstance(v, (list, dict)))
        parsed = _parse(raw, bins, fraction=name == "fill") if raw is not None else None
        if parsed is not None:
            per_pack[name] = parsed
    if "num_packs" not in scalars and source.per_pack is not None:
        scalars["num_packs"] = source.per_pack.num_rows
    return PackStats(scalars=scalars, per_pack=per_pack)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _find(documents: list[dict[str, Any]], keys: tuple[str, ...], accept: Any) -> Any:
    """First value under one of ``keys`` that ``accept`` takes, top level before sections."""
    for document in documents:
        for scope in (document, *(document.get(s) for s in SECTIONS)):
            for key in keys:
                value = _lookup(scope, key)
                if value is not None and accept(value):
                    return value
    return None


def _lookup(scope: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(scope, dict):
            return None
        scope = scope.get(part)
    return scope


def _per_pack_columns(table: pa.Table | None, pack_size: Number | None) -> dict[str, np.ndarray]:
    """Per-pack arrays from ``pack_stats.arrow``; token counts -> fill given ``pack_size``."""
    if table is None:
        return {}
    out = {}
    for name, keys in PER_PACK_COLUMNS.items():
        key = next((k for k in keys if k in table.column_names), None)
        if key is not None:
            out[name] = table.column(key).to_numpy()
    tokens = next((k for k in TOKENS_COLUMNS if k in table.column_names), None)
    if "fill" not in out and tokens is not None and pack_size:
        out["fill"] = table.column(tokens).to_numpy() / float(pack_size)
    return out


def _parse(raw: list | dict, bins: int, fraction: bool) -> Distribution | None:
    """One per-pack quantity in any accepted form (module docstring), else None."""
    if isinstance(raw, list):
        return _from_values(np.asarray(raw), bins, fraction) if all(map(_is_number, raw)) else None
    edges = _first(raw, ("edges", "bin_edges", "bins"))
    counts = _first(raw, ("counts", "bin_counts", "hist"))
    if _numbers(edges) and _numbers(counts) and len(edges) == len(counts) + 1:
        summary = {k: raw[k] for k in SUMMARY_KEYS if _is_number(raw.get(k))}
        summary.setdefault("count", int(sum(counts)))
        histogram = Histogram(edges=tuple(edges), counts=tuple(int(c) for c in counts))
        return Distribution(**summary, histogram=histogram)
    ranges = _range_histogram(raw)
    if ranges is not None:
        return Distribution(count=sum(ranges.counts), histogram=ranges)
    if raw and all(_is_numeric_text(k) and _is_number(v) for k, v in raw.items()):
        keys = sorted(raw, key=float)
        values = np.repeat([float(k) for k in keys], [int(raw[k]) for k in keys])
        if all(float(k).is_integer() for k in keys):
            values = values.astype(np.int64)
        return _from_values(values, bins, fraction)
    summary = {k: raw[k] for k in SUMMARY_KEYS if _is_number(raw.get(k))}
    if summary:
        summary.setdefault("count", 0)
        return Distribution(**summary)
    return None


def _from_values(values: np.ndarray, bins: int, fraction: bool) -> Distribution:
    """Fill fractions get equal bins over [0, 1]; whole numbers get integer bins."""
    values = np.asarray(values)
    is_fraction = fraction and values.dtype.kind == "f" and (values.size == 0 or values.max() <= 1.0)
    if is_fraction:
        return distribution(values, fraction_edges(bins))
    if values.dtype.kind == "f" and np.all(values == np.floor(values)):
        values = values.astype(np.int64)
    if values.dtype.kind == "f":
        return distribution(values, np.histogram_bin_edges(values, bins=bins))
    return distribution(values, integer_edges(values, bins))


def _first(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((raw[k] for k in keys if k in raw), None)


def _numbers(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_is_number, value))


def _range_histogram(raw: dict[str, Any]) -> Histogram | None:
    """``{"0.0-0.1": 3, "0.1-0.2": 0, ...}``: contiguous ``lo-hi`` labels -> a histogram."""
    bins = []
    for label, count in raw.items():
        match = RANGE_LABEL.match(label)
        if match is None or not _is_number(count):
            return None
        bins.append((float(match[1]), float(match[2]), int(count)))
    bins.sort()
    if not bins or any(a[1] != b[0] for a, b in zip(bins, bins[1:])):
        return None
    edges = tuple(lo for lo, _, _ in bins) + (bins[-1][1],)
    return Histogram(edges=edges, counts=tuple(c for _, _, c in bins))


def _is_numeric_text(key: str) -> bool:
    try:
        float(key)
    except ValueError:
        return False
    return True
