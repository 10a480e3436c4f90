"""Packing plan: which samples share a pack, computed from token counts alone.

Inputs: one length per sample (tokens, >= 1), optional media tokens per sample, options.
Output: a `PackAssignment` in CSR form: pack p holds `item_order[pack_offsets[p]:pack_offsets[p+1]]`.
Invariants (checked by `verify_plan`): every sample sits in exactly one pack or in `oversize`;
no pack's slot lengths sum past `pack_size`; no pack holds more than `max_samples_per_pack`.

Algorithm: slot = length rounded up to `pad_to_multiple_of`; slots > pack_size go to
`oversize`; a stable counting sort orders slots longest first (ties: lower index first);
best-fit decreasing puts each slot into the open pack with the least room that still fits
(ties: the pack touched most recently), found in O(log C) by a segment tree over remaining
room; the pack order is then shuffled by seed (BFD emits packs grouped by length).

Worked example, pack_size=1000, seed=0::

    index   0    1    2    3    4    5    6    7
    length  300  900  500  200  700  100  400  800

    BFD order: 900(1) 800(7) 700(4) 500(2) 400(6) 300(0) 200(3) 100(5)
    packs:     A=[1]  B=[7, 3]  C=[4, 0]  D=[2, 6, 5]      (100 fits A and D: D is newer)
    loads:     900    1000      1000      1000
    shuffled:  pack_offsets=[0, 2, 3, 5, 8]  item_order=[4, 0, 1, 7, 3, 2, 6, 5]
    num_packs=4  lb2=4  num_tokens=3900  efficiency=3900/(4*1000)=0.975
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prep.pack.assignment import PackAssignment
from prep.pack.bounds import lower_bound_l2
from schemas.plan import slot_tokens


@njit(cache=True)
def _counting_sort_desc(values: np.ndarray, max_value: int) -> tuple[np.ndarray, np.ndarray]:
    """Order (longest first, stable) and the sorted values, written as runs, not gathered."""
    counts = np.zeros(max_value + 1, np.int64)
    for v in values:
        counts[v] += 1
    start = np.empty(max_value + 1, np.int64)
    sorted_values = np.empty(values.size, np.int64)
    acc = 0
    for v in range(max_value, -1, -1):
        start[v] = acc
        sorted_values[acc : acc + counts[v]] = v
        acc += counts[v]
    order = np.empty(values.size, np.int64)
    for i in range(values.size):
        v = values[i]
        order[start[v]] = i
        start[v] += 1
    return order, sorted_values


def counting_sort_desc(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Indices that order `lengths` longest first, ties by index: O(n + max_len), no compares.

    Raises:
        ValueError: A length is negative or above `max_len`.
    """
    values = np.asarray(lengths, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() > max_len):
        raise ValueError(f"lengths must lie in [0, {max_len}]")
    return _counting_sort_desc(values, int(max_len))[0]


@njit(cache=True)
def _tree_add(tree: np.ndarray, base: int, leaf: int, delta: int) -> None:
    i = base + leaf
    while i >= 1:
        tree[i] += delta
        i >>= 1


@njit(cache=True)
def _tree_first_at_least(tree: np.ndarray, base: int, leaf: int) -> int:
    """Smallest non-empty leaf >= `leaf`, or -1."""
    i = base + leaf
    if tree[i] > 0:
        return leaf
    while i > 1:
        if (i & 1) == 0 and tree[i + 1] > 0:
            i += 1
            while i < base:
                i = 2 * i if tree[2 * i] > 0 else 2 * i + 1
            return i - base
        i >>= 1
    return -1


@njit(cache=True)
def bfd_pack(sizes: np.ndarray, capacity: int, max_items: int) -> tuple[np.ndarray, int]:
    """Best fit over `sizes` in the given order (non-increasing gives BFD); O(n log C).

    Open packs sit in stacks keyed by exact remaining room; a segment tree counting
    non-empty stacks finds the smallest room >= size. A pack that is full or holds
    `max_items` items closes.

    Returns:
        Pack id of each position (ids in order of opening) and the number of packs.
    """
    n = sizes.size
    base = 1
    while base < capacity + 1:
        base <<= 1
    tree = np.zeros(2 * base, np.int32)
    head = np.full(capacity + 1, -1, np.int64)
    below = np.empty(n, np.int64)
    count = np.zeros(n, np.int64)
    pack_of = np.empty(n, np.int64)
    num = 0
    for k in range(n):
        s = sizes[k]
        if s < 1 or s > capacity:
            raise ValueError("bfd_pack: every size must lie in [1, capacity]")
        room = _tree_first_at_least(tree, base, s)
        if room < 0:
            b = num
            num += 1
            room = capacity
        else:
            b = head[room]
            head[room] = below[b]
            if head[room] < 0:
                _tree_add(tree, base, room, -1)
        room -= s
        count[b] += 1
        pack_of[k] = b
        if room > 0 and count[b] < max_items:
            below[b] = head[room]
            head[room] = b
            if below[b] < 0:
                _tree_add(tree, base, room, 1)
    return pack_of, num


@njit(cache=True)
def _group_by_pack(pack_of: np.ndarray, rank: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR of `items` by output pack `rank[pack_of]`, stable, in one pass: offsets, items."""
    num = rank.size
    offsets = np.zeros(num + 1, np.int64)
    for b in pack_of:
        offsets[rank[b] + 1] += 1
    for p in range(num):
        offsets[p + 1] += offsets[p]
    cursor = offsets[:-1].copy()
    grouped = np.empty(items.size, np.int64)
    for k in range(items.size):
        p = rank[pack_of[k]]
        grouped[cursor[p]] = items[k]
        cursor[p] += 1
    return offsets, grouped


def _pack_sequence(num: int, loads: np.ndarray | None, group_size: int, rng: np.random.Generator) -> np.ndarray:
    """Pack ids in output order: a shuffle, or media-balanced groups when `loads` is given.

    Balanced: sort packs by media load (ties random), cut into groups of `group_size`
    consecutive packs (one training step across data-parallel ranks), shuffle the groups
    and the packs inside each group; the remainder (< group_size heaviest) goes last so
    every full group starts at a multiple of `group_size`.
    """
    if loads is None:
        return rng.permutation(num)
    by_load = np.lexsort((rng.random(loads.size), loads))
    full = loads.size // group_size * group_size
    groups = by_load[:full].reshape(-1, group_size)
    groups = rng.permuted(groups[rng.permutation(groups.shape[0])], axis=1)
    return np.concatenate([groups.ravel(), rng.permutation(by_load[full:])])


def _check_options(**options: int | None) -> None:
    for name, value in options.items():
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def plan_packs(
    lengths: np.ndarray,
    *,
    pack_size: int,
    max_samples_per_pack: int | None = None,
    pad_to_multiple_of: int = 1,
    seed: int = 0,
    media_tokens: np.ndarray | None = None,
    balance_media: bool = False,
    media_group_size: int = 8,
) -> PackAssignment:
    """Plan packs for all samples at once; same inputs and options give the same plan.

    Args:
        lengths: Tokens per sample (>= 1), e.g. a `num_tokens` column.
        pack_size: Tokens per pack.
        max_samples_per_pack: Optional cap on samples per pack (a full pack closes).
        pad_to_multiple_of: Each slot is the length rounded up to this (context parallelism).
        seed: Seed for the pack order.
        media_tokens: Media tokens per sample; read only when `balance_media`.
        balance_media: Order packs so each run of `media_group_size` packs, which meets in
            one step across data-parallel ranks, carries similar media loads.
        media_group_size: Packs per step, e.g. data-parallel size x micro-batches.

    Raises:
        ValueError: A bad option, a length < 1, or `balance_media` without `media_tokens`.
    """
    _check_options(
        pack_size=pack_size,
        max_samples_per_pack=max_samples_per_pack,
        pad_to_multiple_of=pad_to_multiple_of,
        media_group_size=media_group_size,
    )
    lengths = np.array(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
        raise ValueError("lengths must be a 1-D array of integers >= 1")
    if balance_media and (media_tokens is None or np.shape(media_tokens) != lengths.shape):
        raise ValueError("balance_media needs media_tokens with one entry per sample")
    unit = int(pad_to_multiple_of)
    units = lengths if unit == 1 else slot_tokens(lengths, unit) // unit
    capacity = int(pack_size) // unit
    n_over = int(np.count_nonzero(units > capacity))
    keys = np.minimum(units, capacity + 1) if n_over else units
    order, sorted_units = _counting_sort_desc(keys, capacity + 1)
    oversize = np.sort(order[:n_over])
    sorted_idx, fit_units = order[n_over:], sorted_units[n_over:]
    cap = int(max_samples_per_pack or fit_units.size + 1)
    pack_of, num = bfd_pack(fit_units, capacity, cap)
    media = np.asarray(media_tokens, dtype=np.float64)[sorted_idx] if balance_media else None
    loads = None if media is None else np.bincount(pack_of, weights=media, minlength=num)
    sequence = _pack_sequence(num, loads, int(media_group_size), np.random.default_rng(seed))
    rank = np.empty(num, np.int64)
    rank[sequence] = np.arange(num)
    offsets, item_order = _group_by_pack(pack_of, rank, sorted_idx)
    slot_lengths = units * unit if unit > 1 else lengths
    lb2 = max(lower_bound_l2(fit_units, capacity), -(-fit_units.size // cap))
    num_tokens = int(lengths.sum() - lengths[oversize].sum())
    for array in (offsets, item_order, oversize, slot_lengths):
        array.flags.writeable = False
    return PackAssignment(
        pack_size=int(pack_size),
        pad_to_multiple_of=unit,
        max_samples_per_pack=max_samples_per_pack,
        seed=seed,
        pack_offsets=offsets,
        item_order=item_order,
        oversize=oversize,
        slot_lengths=slot_lengths,
        num_packs=int(num),
        lb2=lb2,
        num_tokens=num_tokens,
        slot_tokens=int(fit_units.sum()) * unit,
        efficiency=num_tokens / (num * pack_size) if num else 0.0,
    )
