"""Train/val/test splits of a packed dataset: names, the ratio option and its pack counts.

`prep pack --split-ratio` assigns packs to splits in plan order (train first, then val,
then test) and cuts shards so none spans two splits; `prep energon-index --split-ratio`
checks a shard-boundary split against the same counts. Both use `split_pack_counts`.

Example: ratio 0.98,0.02,0 over 10 packs -> quotas 9.8, 0.2, 0 -> largest remainder gives
10, 0, 0; val's ratio is non-zero, so it gets one pack from train -> counts (9, 1, 0).
"""

from __future__ import annotations

import math

from packvlm.errors import UsageError

SPLIT_NAMES: tuple[str, str, str] = ("train", "val", "test")
SplitRatio = tuple[float, float, float]


class SplitRatioError(UsageError, ValueError):  # a usage error: raised while parsing the option
    """``--split-ratio`` is not three numbers >= 0 with train > 0."""


def parse_split_ratio(text: str) -> SplitRatio:
    """``"0.98,0.02,0"`` -> (0.98, 0.02, 0.0); ratios are normalised by `split_pack_counts`."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError as exc:
        raise SplitRatioError(f"--split-ratio {text!r}: use three numbers train,val,test like 0.98,0.02,0") from exc
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values) or values[0] <= 0:
        raise SplitRatioError(f"--split-ratio {text!r}: need three numbers train,val,test >= 0 with train > 0")
    return values[0], values[1], values[2]


def split_pack_counts(ratio: SplitRatio, num_packs: int) -> tuple[int, int, int]:
    """Packs per split: the integer counts summing to ``num_packs`` closest to the quotas.

    Largest remainder (each split gets the floor of its quota ``ratio / sum(ratio) *
    num_packs``, the rest go to the largest fractional parts, ties to the earlier split),
    under one constraint: when there are at least as many packs as non-zero ratios, every
    non-zero ratio gets at least one pack (taken from the split furthest above its quota).
    The result minimises the squared distance to the quotas under that constraint.
    """
    total = sum(ratio)
    quotas = [r / total * num_packs for r in ratio]
    nonzero = [r > 0 for r in ratio]
    floor_one = num_packs >= sum(nonzero)
    low = [1 if nz and floor_one else 0 for nz in nonzero]
    counts = [max(lo, math.floor(q)) for lo, q in zip(low, quotas)]
    while sum(counts) < num_packs:  # at most 3 rounds: the floors leave < 1 pack per split
        i = max(range(3), key=lambda k: (quotas[k] - counts[k], -k))
        counts[i] += 1
    while sum(counts) > num_packs:  # only when a forced pack pushed the total over
        i = max((k for k in range(3) if counts[k] > low[k]), key=lambda k: (counts[k] - quotas[k], k))
        counts[i] -= 1
    return counts[0], counts[1], counts[2]


def split_offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Pack offsets of the splits in plan order: split s holds packs [offsets[s], offsets[s+1])."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return tuple(out)
