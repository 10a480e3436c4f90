"""Which shards `prep energon-index` puts in which split; Energon splits by whole shard files.

Without split options the split is the one `prep pack --split-ratio` recorded (its shards
never span two splits; `PackManifest.splits`). With ``--split-ratio`` the split boundaries
move to the shard boundaries nearest the pack counts `schemas.splits.split_pack_counts`
wants, and the result is refused when it is far from them: a split with a non-zero ratio
left empty, or any split off by more than ``max(1 pack, 5 % of packs)``.

Example: shards of 4 and 1 packs, ``--split-ratio 0.98,0.02,0`` -> wanted (4, 1, 0) ->
train = shard 0 (4 packs), val = shard 1 (1 pack). One shard of 10 packs with the same
ratio -> train 10, val 0: refused (use ``prep pack --split-ratio``).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from schemas.manifest import PackManifest
from schemas.splits import SPLIT_NAMES, SplitRatio, split_pack_counts

TOLERANCE_FRACTION = 0.05  # of all packs; at least one pack
_NOTHING = "(?!)"  # a regex that matches no shard: an empty split


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSplit:
    """Shards [bounds[i], bounds[i+1]) of the shard list form split SPLIT_NAMES[i], with packs[i] packs."""

    bounds: tuple[int, ...]
    packs: tuple[int, ...]
    wanted: tuple[int, ...] | None = None  # pack counts a --split-ratio asked for

    def parts(self, shard_names: list[str]) -> dict[str, list[str]]:
        """Shard names per split, in SPLIT_NAMES order (empty splits included)."""
        return {name: shard_names[a:b] for name, a, b in zip(SPLIT_NAMES, self.bounds, self.bounds[1:])}


def recorded_split(manifest: PackManifest) -> ShardSplit:
    """The split `prep pack` recorded (every pack in train when it was given no --split-ratio)."""
    by_name = {s.name: s for s in manifest.splits}
    firsts = [by_name[name].first_shard for name in SPLIT_NAMES]
    last = by_name[SPLIT_NAMES[-1]]
    return ShardSplit(
        bounds=(*firsts, last.first_shard + last.shards), packs=tuple(by_name[name].packs for name in SPLIT_NAMES)
    )


def _candidates(cum: list[int], target: int) -> set[int]:
    """The shard boundaries just below and just above ``target`` packs."""
    j = bisect.bisect_left(cum, target)
    return {min(j, len(cum) - 1), max(j - 1, 0)}


def nearest_split(shard_packs: list[int], ratio: SplitRatio) -> ShardSplit:
    """The shard-boundary split closest to the pack counts ``ratio`` wants.

    Among the boundaries next to each wanted cut, prefer: fewer splits empty when their ratio
    is not zero or not empty when it is, then the smaller largest deviation, then the smaller
    total deviation, then earlier boundaries.
    """
    cum = list(itertools.accumulate(shard_packs, initial=0))
    wanted = split_pack_counts(ratio, cum[-1])
    cut1, cut2 = wanted[0], wanted[0] + wanted[1]

    def score(b: tuple[int, int]) -> tuple[int, int, int, tuple[int, int]]:
        packs = (cum[b[0]], cum[b[1]] - cum[b[0]], cum[-1] - cum[b[1]])
        dev = [abs(p - w) for p, w in zip(packs, wanted)]
        wrong = sum(1 for p, r in zip(packs, ratio) if (r > 0) != (p > 0))
        return wrong, max(dev), sum(dev), b

    pairs = [(b1, b2) for b1 in _candidates(cum, cut1) for b2 in _candidates(cum, cut2) if b1 <= b2]
    b1, b2 = min(pairs, key=score)
    bounds = (0, b1, b2, len(shard_packs))
    return ShardSplit(bounds=bounds, packs=tuple(cum[b] - cum[a] for a, b in zip(bounds, bounds[1:])), wanted=wanted)


def refusal(split: ShardSplit, ratio: SplitRatio) -> str | None:
    """Why ``split`` does not honour ``ratio`` (None when it does)."""
    wanted = split.wanted or split.packs
    total = sum(split.packs)
    tolerance = max(1.0, TOLERANCE_FRACTION * total)
    problems = []
    for name, p, w, r in zip(SPLIT_NAMES, split.packs, wanted, ratio):
        if r > 0 and p == 0:
            problems.append(f"{name} gets no pack")
        elif abs(p - w) > tolerance:
            problems.append(f"{name} is off by {abs(p - w):,} packs")
    if not problems:
        return None
    ratio_text = ",".join(f"{r:g}" for r in ratio)
    return (
        f"--split-ratio {ratio_text}: Energon splits by whole shards, and the nearest shard split gives "
        f"{format_counts(split.packs)} of {total:,} packs where {format_counts(wanted)} are wanted "
        f"({'; '.join(problems)}). Split on pack boundaries instead: `prep pack ... --split-ratio {ratio_text}` "
        "and then `prep energon-index DIR` with no split option, or re-pack with a smaller --shard-size."
    )


def format_counts(packs: tuple[int, ...]) -> str:
    """``train 9, val 1, test 0``."""
    return ", ".join(f"{name} {p:,}" for name, p in zip(SPLIT_NAMES, packs))


def _literal(name: str) -> str:
    """A regex matching ``name`` literally, without backslashes (Energon brace-expands patterns,
    and braceexpand drops backslashes): specials go in a one-character class."""
    if any(c in name for c in "\\{}[]^"):
        raise ValueError(f"shard name {name!r} cannot be written as an Energon split pattern")
    return "".join(c if c.isalnum() or c in "/_-" else f"[{c}]" for c in name)


def energon_patterns(parts: dict[str, list[str]]) -> list[tuple[str, str]]:
    """One ``(split, regex)`` per split for `prepare_dataset(split_parts_patterns=...)`: the
    regex matches exactly that split's shard names (Energon ``re.match``es each shard path)."""
    return [
        (name, f"(?:{'|'.join(_literal(s) for s in shards)})$" if shards else _NOTHING)
        for name, shards in parts.items()
    ]
