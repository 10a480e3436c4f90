"""Pure statistics: Arrow columns of a tokenized directory (and pack data) -> :class:`Stats`.

Each length column gets one set of bin edges computed over all samples, shared by every
dataset and by the overall group, so histograms of different datasets line up. Example,
two datasets, ``num_tokens`` of a = [3, 5], b = [5, 9], bins=3::

    edges [3, 6, 9, 12]   a: counts [2, 0, 0]   b: counts [1, 0, 1]   overall: [3, 0, 1]
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prep.errors.core import ReasonGroup, examples_at, first_rows, group_reasons
from prep.stats.packs import collect_packs
from prep.stats.read import StatsInput, TokenizedTables
from prep.stats.records import GroupStats, Stats, distribution, log_integer_edges

LENGTH_COLUMNS = ("num_text_tokens", "num_media_tokens", "num_tokens")
EXAMPLES_PER_REASON = 3  # error rows shown per reason in the report; `prep errors` shows more


def collect_stats(data: StatsInput, bins: int) -> Stats:
    """Statistics of one directory's tables; deterministic for the same input and bins."""
    datasets: dict[str, GroupStats] = {}
    overall = None
    examples: tuple[ReasonGroup, ...] = ()
    if data.tokenized is not None:
        datasets, overall = collect_tokenized(data.tokenized, bins)
        examples = error_examples(data.tokenized.errors, overall.errors_by_reason, EXAMPLES_PER_REASON)
    packs = collect_packs(data.packed, bins) if data.packed is not None else None
    return Stats(
        stage=data.stage,
        bins=bins,
        datasets=datasets,
        overall=overall,
        packs=packs,
        notes=data.notes,
        error_examples=examples,
    )


def error_examples(errors: pa.Table, counts: dict[str, int], limit: int) -> tuple[ReasonGroup, ...]:
    """Per reason (most frequent first): its count and its first ``limit`` rows in part order.

    Only the example rows' ``sample_id``/``source``/``line``/``message`` are materialised;
    the selection is `prep errors`' own (`prep.errors.core`), so both show the same rows.
    """
    rows = first_rows(errors, None, {reason: limit for reason in counts})
    return group_reasons(counts, {reason: examples_at(errors, indices) for reason, indices in rows.items()})


def collect_tokenized(tables: TokenizedTables, bins: int) -> tuple[dict[str, GroupStats], GroupStats]:
    """Per-dataset and overall statistics of the samples and errors tables."""
    samples, errors = tables.samples, tables.errors
    sample_ds = _strings(samples.column("dataset"))
    error_ds = _strings(errors.column("dataset"))
    reasons = _strings(errors.column("reason"))
    lengths = {c: samples.column(c).to_numpy() for c in LENGTH_COLUMNS}
    edges = {c: log_integer_edges(v, bins) for c, v in lengths.items()}
    kinds, item_owner, items_per_sample = _media(samples.column("media"))
    names = sorted(set(sample_ds.tolist()) | set(error_ds.tolist()))
    everyone = np.ones(len(sample_ds), dtype=bool)
    groups = {}
    for name in names:
        rows = sample_ds == name
        groups[name] = _group(
            rows, lengths, edges, kinds[rows[item_owner]], items_per_sample, reasons[error_ds == name]
        )
    overall = _group(everyone, lengths, edges, kinds, items_per_sample, reasons)
    return groups, overall


def _group(
    rows: np.ndarray,
    lengths: dict[str, np.ndarray],
    edges: dict[str, np.ndarray],
    kinds: np.ndarray,
    items_per_sample: np.ndarray,
    reasons: np.ndarray,
) -> GroupStats:
    """One group: ``rows`` selects its samples; ``kinds`` and ``reasons`` are already its own."""
    return GroupStats(
        samples=int(rows.sum()),
        errors=int(reasons.size),
        media_items=_counts(kinds),
        samples_with_media=int((items_per_sample[rows] > 0).sum()),
        lengths={c: distribution(v[rows], edges[c]) for c, v in lengths.items()},
        errors_by_reason=_counts(reasons),
    )


def _media(media: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kind of every media item, the sample row owning it, and items per sample."""
    items_per_sample = np.asarray(pc.list_value_length(media).to_numpy(zero_copy_only=False), dtype=np.int64)
    owner = np.repeat(np.arange(items_per_sample.size), items_per_sample)
    if owner.size == 0:
        return np.array([], dtype=object), owner, items_per_sample
    kinds = _strings(pc.struct_field(pc.list_flatten(media), "kind"))
    return kinds, owner, items_per_sample


def _strings(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A string column as a numpy object array, each distinct value decoded once."""
    if len(column) == 0:
        return np.array([], dtype=object)
    distinct = pc.unique(column)
    codes = pc.index_in(column, value_set=distinct).to_numpy(zero_copy_only=False)
    return np.array(distinct.to_pylist(), dtype=object)[codes]


def _counts(values: np.ndarray) -> dict[str, int]:
    return dict(sorted(Counter(values.tolist()).items()))
