"""Lower bounds on the number of packs, to judge a plan against the optimum it cannot see.

L1 = ceil(sum / C) counts tokens only; L2 (Martello & Toth, 1990) adds the room that
items longer than C/2 waste, since no two of them share a pack. Both are <= OPT.
Example, C=10, sizes [6, 6, 6, 2]: L1 = ceil(20/10) = 2, L2 = 3 (three sizes > 5).
"""

from __future__ import annotations

import numpy as np


def lower_bound_l1(lengths: np.ndarray, capacity: int) -> int:
    """Continuous bound ceil(sum / C): packs needed if samples could be split."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return -(-total // capacity)


def lower_bound_l2(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 in O(n + C): L1 plus the room items over C/2 waste.

    For alpha in [0, C/2]: J1 = items > C - alpha, J2 = items in (C/2, C - alpha],
    J3 = items in [alpha, C/2]; each J1/J2 item needs its own pack, J1 packs take no J3
    item, and J3 must spill whatever J2 packs cannot hold.

    Raises:
        ValueError: A length lies outside [1, capacity].
    """
    sizes = np.asarray(lengths)
    if sizes.size == 0:
        return 0
    if sizes.min() < 1 or sizes.max() > capacity:
        raise ValueError(f"lengths must lie in [1, {capacity}] for a lower bound")
    return lower_bound_l2_counts(np.bincount(sizes, minlength=capacity + 1), capacity)


def lower_bound_l2_counts(hist: np.ndarray, capacity: int) -> int:
    """`lower_bound_l2` from ``hist[v]`` = number of lengths equal to v (v in 0..capacity, hist[0] = 0).

    The packer has this histogram already (its counting sort), so the bound costs O(C), not O(n).
    """
    c, half = capacity, capacity // 2
    hist = np.asarray(hist, dtype=np.int64)[: c + 1]
    count_le = np.cumsum(hist)
    if count_le[-1] == 0:
        return 0
    sum_le = np.cumsum(hist * np.arange(c + 1, dtype=np.int64))
    alpha = np.arange(half + 1)
    n_j1 = count_le[c] - count_le[c - alpha]
    n_j2 = count_le[c - alpha] - count_le[half]
    sum_j2 = sum_le[c - alpha] - sum_le[half]
    sum_j3 = sum_le[half] - np.where(alpha > 0, sum_le[np.maximum(alpha - 1, 0)], 0)
    spill = np.maximum(0, -(-(sum_j3 - (n_j2 * c - sum_j2)) // c))
    l1 = -(-int(sum_le[c]) // c)
    return int(max(l1, (n_j1 + n_j2 + spill).max()))
