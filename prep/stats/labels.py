"""Readable names and formats of the report's numbers; ``stats.json`` keeps the raw keys.

Fractions (efficiency, fill) read as percentages the way `prep pack` prints them
(``0.959712 -> 95.97%``); counts get thousands separators (``12345 -> 12,345``).
"""

from __future__ import annotations

from prep.stats.records import Number, PackStats

# PackStats field -> label, in report order; one group per line of the terminal summary.
PACK_GROUPS: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("num_samples", "tokenized samples"),
        ("packed_samples", "packed samples"),
        ("oversize", "oversize samples (dropped)"),
    ),
    (
        ("pack_size", "pack size (tokens)"),
        ("num_packs", "packs"),
        ("lb1", "lower bound L1 (packs)"),
        ("lb2", "lower bound L2 (packs)"),
        ("packs_over_lb2", "packs above lower bound L2"),
    ),
    (
        ("efficiency", "efficiency (real tokens / pack capacity)"),
        ("num_tokens", "real tokens in packs"),
        ("pad_tokens", "slot padding tokens"),
        ("empty_tokens", "empty tokens (unused capacity)"),
    ),
    (("num_shards", "shards"), ("shard_bytes", "shard bytes")),
)
PER_PACK_LABELS: tuple[tuple[str, str], ...] = (
    ("fill", "fill (tokens / pack size)"),
    ("samples_per_pack", "samples per pack"),
    ("media_per_pack", "media items per pack"),
)
FRACTIONS = frozenset({"efficiency", "fill"})


def format_number(value: Number | None, fraction: bool = False) -> str:
    """``None -> "-"``; a fraction as a percentage; ints with separators; floats to 4 digits."""
    if value is None:
        return "-"
    if fraction:
        return f"{value:.2%}"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def pack_rows(packs: PackStats) -> list[list[tuple[str, str]]]:
    """(label, formatted value) per plan-level number, in report order, by group."""
    return [[(label, format_number(getattr(packs, key), key in FRACTIONS)) for key, label in g] for g in PACK_GROUPS]
