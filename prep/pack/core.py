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

Memory (issue 21): the sorted order is never stored. A histogram of slot sizes drives BFD
run by run (equal sizes need a tree search only when their best-fit stack runs dry), BFD
writes one pack id per sorted position (int32 below 2^31 samples), and a last pass over the
samples in index order replays the counting sort's positions to scatter each index to its
place. Peak beyond the caller's lengths: two int32 arrays of n plus per-pack arrays; 100M
lengths plan in ~1.5 GB peak RSS, int32 lengths included (`benchmarks/bench_pack.py --memory`).

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
from prep.pack.bounds import lower_bound_l2_counts
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
def _unit_counts(lengths: np.ndarray, unit: int, capacity: int) -> np.ndarray:
    """``counts[u]``: samples of slot ``u`` units (u in 1..capacity); ``counts[capacity + 1]``: oversize."""
    counts = np.zeros(capacity + 2, np.int64)
    for length in lengths:
        counts[min((length + unit - 1) // unit, capacity + 1)] += 1
    return counts


@njit(cache=True)
def _bfd_runs(
    counts: np.ndarray, capacity: int, max_items: int, max_packs: int, pack_of: np.ndarray
) -> tuple[np.ndarray, int]:
    """Best-fit decreasing over runs of equal sizes (``counts[s]`` items of size s, s = C..1).

    Open packs sit in stacks keyed by exact remaining room; a segment tree counting
    non-empty stacks finds the smallest room >= size. Within a run the next item's room is
    known without a search: the room just left if it still fits the size, else the same
    stack while it is not empty; the tree is searched only when that stack runs dry. A pack
    that is full or holds `max_items` items closes. Writes ``pack_of[k]``, the pack (ids in
    order of opening) of the k-th item in decreasing order, ties by index.

    Returns:
        Items per pack, and the number of packs.
    """
    base = 1
    while base < capacity + 1:
        base <<= 1
    tree = np.zeros(2 * base, np.int32)
    head = np.full(capacity + 1, -1, pack_of.dtype)
    below = np.empty(max_packs, pack_of.dtype)
    count = np.zeros(max_packs, np.int32)
    num = 0
    k = 0
    for s in range(capacity, 0, -1):
        if counts[s] == 0:
            continue
        room = _tree_first_at_least(tree, base, s)
        for _ in range(counts[s]):
            if room < 0:
                if num == max_packs:
                    raise ValueError("_bfd_runs: more packs than the any-fit bound; a bug")
                b = num
                num += 1
                left = capacity - s
            else:
                b = head[room]
                head[room] = below[b]
                if head[room] < 0:
                    _tree_add(tree, base, room, -1)
                left = room - s
            count[b] += 1
            pack_of[k] = b
            k += 1
            pushed = left > 0 and count[b] < max_items
            if pushed:
                below[b] = head[left]
                head[left] = b
                if below[b] < 0:
                    _tree_add(tree, base, left, 1)
            if pushed and left >= s:  # below every other room that fits: the new best fit
                room = left
            elif room >= 0 and head[room] < 0:  # the best-fit stack ran dry: next room up
                room = _tree_first_at_least(tree, base, room + 1) if room < capacity else -1
    return count[:num], num


@njit(cache=True)
def _pack_media_loads(
    lengths: np.ndarray, unit: int, capacity: int, starts: np.ndarray, pack_of: np.ndarray, media: np.ndarray, num: int
) -> np.ndarray:
    """Media tokens per pack (float64 sums of integers: exact in any order)."""
    cursor = starts.copy()
    loads = np.zeros(num, np.float64)
    for i in range(lengths.size):
        u = min((lengths[i] + unit - 1) // unit, capacity + 1)
        if u <= capacity:
            loads[pack_of[cursor[u]]] += media[i]
            cursor[u] += 1
    return loads


@njit(cache=True)
def _place(
    lengths: np.ndarray,
    unit: int,
    capacity: int,
    starts: np.ndarray,
    pack_of: np.ndarray,
    rank: np.ndarray,
    offsets: np.ndarray,
    oversize: np.ndarray,
) -> np.ndarray:
    """Sample indices pack by pack (packs in `rank` order; inside a pack in decreasing order,
    ties by index) without materialising the sorted order: ``pack_of`` becomes each sorted
    position's destination in place, then a pass over samples in index order revisits the
    counting sort's positions (``starts``: first sorted position of each size) and scatters.
    Fills ``oversize`` (ascending) on the way.
    """
    cursor = offsets[:-1].copy()
    for k in range(pack_of.size):
        p = rank[pack_of[k]]
        pack_of[k] = cursor[p]
        cursor[p] += 1
    items = np.empty(pack_of.size, pack_of.dtype)
    position = starts.copy()
    n_over = 0
    for i in range(lengths.size):
        u = min((lengths[i] + unit - 1) // unit, capacity + 1)
        if u > capacity:
            oversize[n_over] = i
            n_over += 1
        else:
            items[pack_of[position[u]]] = i
            position[u] += 1
    return items


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
        lengths: Tokens per sample (>= 1), e.g. a `num_tokens` column; any integer dtype, never
            copied (int32 takes half the memory of int64).
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
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":
        lengths = lengths.astype(np.int64)
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
        raise ValueError("lengths must be a 1-D array of integers >= 1")
    if balance_media and (media_tokens is None or np.shape(media_tokens) != lengths.shape):
        raise ValueError("balance_media needs media_tokens with one entry per sample")
    unit = int(pad_to_multiple_of)
    capacity = int(pack_size) // unit
    counts = _unit_counts(lengths, unit, capacity)
    n_over = int(counts[capacity + 1])
    n_fit = lengths.size - n_over
    sizes = np.arange(capacity + 1, dtype=np.int64)
    fit_units = int(counts[: capacity + 1] @ sizes)
    cap = int(max_samples_per_pack or n_fit + 1)
    index = np.int32 if lengths.size < 2**31 else np.int64
    max_packs = min(n_fit, n_fit // cap + 2 * fit_units // max(capacity, 1) + 2)  # any-fit: <= 1 pack half empty
    pack_of = np.empty(n_fit, index)
    per_pack, num = _bfd_runs(counts, capacity, cap, max_packs, pack_of)
    starts = np.zeros(capacity + 2, np.int64)  # first sorted position of each size, sizes descending
    starts[1 : capacity + 1] = np.cumsum(counts[capacity:0:-1])[::-1] - counts[1 : capacity + 1]
    loads = None
    if balance_media:
        media = np.asarray(media_tokens, dtype=np.float64)
        loads = _pack_media_loads(lengths, unit, capacity, starts, pack_of, media, num)
    sequence = _pack_sequence(num, loads, int(media_group_size), np.random.default_rng(seed))
    rank = np.empty(num, index)
    rank[sequence] = np.arange(num)
    offsets = np.zeros(num + 1, np.int64)
    np.cumsum(per_pack[sequence], out=offsets[1:])
    del sequence, per_pack
    oversize = np.empty(n_over, np.int64)
    item_order = _place(lengths, unit, capacity, starts, pack_of, rank, offsets, oversize)
    del pack_of, rank
    slot_lengths = slot_tokens(lengths, unit) if unit > 1 else lengths.view()
    num_tokens = int(lengths.sum(dtype=np.int64) - lengths[oversize].sum(dtype=np.int64))
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
        lb2=max(lower_bound_l2_counts(counts[: capacity + 1], capacity), -(-n_fit // cap)),
        num_tokens=num_tokens,
        slot_tokens=fit_units * unit,
        efficiency=num_tokens / (num * pack_size) if num else 0.0,
    )
