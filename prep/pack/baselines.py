"""Packers we compare against (tests and benchmarks only; the stage uses `core.plan_packs`).

Each takes lengths in input order and returns (pack id per sample, number of packs):

- `ffd_pack`: first-fit decreasing; a max-tree over packs finds the first pack with room,
  O(n log n), so it scales to the 10M benchmark.
- `next_fit_pack`: input order, one open pack; the cheapest online scheme.
- `windowed_ffd_pack`: FFD inside consecutive windows of input order (LLaMA-Factory, TRL
  pack a buffer of ~1,000 samples at a time); packs never span windows.
- `heap_worst_fit_pack`: NeMo Automodel's greedy knapsack: longest first, into the
  least-filled pack if it fits there, else a new pack; capacity scaled by its
  ``packing_ratio`` (default 1.0, where it gives our pack count; 0.9 is a user's choice).

Example, capacity 10, lengths [6, 5, 4, 5]: FFD -> [6, 4] [5, 5] (2 packs); next fit ->
[6] [5, 4] [5] (3 packs).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prep.pack.core import counting_sort_desc


@njit(cache=True)
def _ffd_sorted(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    n = sizes.size
    base = 1
    while base < max(n, 1):
        base <<= 1
    tree = np.full(2 * base, capacity, np.int64)  # max room per subtree; unopened = empty
    pack_of = np.empty(n, np.int64)
    num = 0
    for k in range(n):
        s = sizes[k]
        i = 1
        while i < base:
            i = 2 * i if tree[2 * i] >= s else 2 * i + 1
        tree[i] -= s
        pack_of[k] = i - base
        num = max(num, i - base + 1)
        i >>= 1
        while i >= 1:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i >>= 1
    return pack_of, num


def ffd_pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """First-fit decreasing (ties by index): the classic reference for BFD."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    order = counting_sort_desc(lengths, capacity)
    sorted_packs, num = _ffd_sorted(lengths[order], capacity)
    pack_of = np.empty_like(sorted_packs)
    pack_of[order] = sorted_packs
    return pack_of, num


@njit(cache=True)
def _next_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    pack_of = np.empty(sizes.size, np.int64)
    num, room = 0, 0
    for k in range(sizes.size):
        if sizes[k] > room:
            num += 1
            room = capacity
        room -= sizes[k]
        pack_of[k] = num - 1
    return pack_of, num


def next_fit_pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Next fit in input order: close the open pack as soon as a sample does not fit."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    return _next_fit(lengths, capacity)


@njit(cache=True)
def _windowed_ffd(sizes: np.ndarray, capacity: int, window: int) -> tuple[np.ndarray, int]:
    n = sizes.size
    pack_of = np.empty(n, np.int64)
    rooms = np.empty(window, np.int64)
    num = 0
    for start in range(0, n, window):
        stop = min(start + window, n)
        order = np.argsort(-sizes[start:stop], kind="mergesort")
        opened = 0
        for j in order:
            s = sizes[start + j]
            b = 0
            while b < opened and rooms[b] < s:
                b += 1
            if b == opened:
                rooms[b] = capacity
                opened += 1
            rooms[b] -= s
            pack_of[start + j] = num + b
        num += opened
    return pack_of, num


def windowed_ffd_pack(lengths: np.ndarray, capacity: int, window: int = 1000) -> tuple[np.ndarray, int]:
    """FFD within consecutive windows of `window` samples in input order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    return _windowed_ffd(lengths, capacity, window)


@njit(cache=True)
def _sift_down(heap: np.ndarray, size: int, i: int) -> None:
    while True:
        smallest, left = i, 2 * i + 1
        if left < size and heap[left] < heap[smallest]:
            smallest = left
        if left + 1 < size and heap[left + 1] < heap[smallest]:
            smallest = left + 1
        if smallest == i:
            return
        heap[i], heap[smallest] = heap[smallest], heap[i]
        i = smallest


@njit(cache=True)
def _sift_up(heap: np.ndarray, i: int) -> None:
    while i > 0 and heap[(i - 1) // 2] > heap[i]:
        heap[i], heap[(i - 1) // 2] = heap[(i - 1) // 2], heap[i]
        i = (i - 1) // 2


@njit(cache=True)
def _heap_worst_fit(sizes: np.ndarray, limit: int) -> tuple[np.ndarray, int]:
    n = sizes.size
    shift = np.int64(1) << 32  # heap key = fill * 2^32 + pack id: least fill, then oldest
    heap = np.empty(n, np.int64)
    pack_of = np.empty(n, np.int64)
    size, num = 0, 0
    for k in range(n):
        s = sizes[k]
        if s > limit:  # too long for the scaled capacity: a pack of its own, never reused
            pack_of[k] = num
            num += 1
        elif size > 0 and heap[0] // shift + s <= limit:
            pack_of[k] = heap[0] % shift
            heap[0] += s * shift
            _sift_down(heap, size, 0)
        else:
            pack_of[k] = num
            heap[size] = s * shift + num
            _sift_up(heap, size)
            size += 1
            num += 1
    return pack_of, num


def heap_worst_fit_pack(lengths: np.ndarray, capacity: int, capacity_ratio: float = 1.0) -> tuple[np.ndarray, int]:
    """Worst fit decreasing with a min-heap on fill, packing to capacity_ratio x capacity.

    Samples longer than the scaled capacity (but within `capacity`) get a pack each, so the
    comparison stays lossless.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    order = counting_sort_desc(lengths, capacity)
    sorted_packs, num = _heap_worst_fit(lengths[order], int(capacity * capacity_ratio))
    pack_of = np.empty_like(sorted_packs)
    pack_of[order] = sorted_packs
    return pack_of, num


def _check(lengths: np.ndarray, capacity: int) -> None:
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"lengths must lie in [1, {capacity}]")
