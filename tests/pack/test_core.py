"""Packing plan: properties checked against oracles written independently of `core`.

Oracles: per-pack sums and index conservation recomputed here; an O(n^2) best-fit
reference; an exact optimum by subset DP on tiny instances (for LB1/LB2 and the 3/2 bound).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.pack.assignment import PackAssignment
from prep.pack.baselines import ffd_pack, heap_worst_fit_pack, next_fit_pack, windowed_ffd_pack
from prep.pack.bounds import lower_bound_l1, lower_bound_l2
from prep.pack.core import counting_sort_desc, plan_packs
from prep.pack.verify import PlanInvariantError, verify_plan

FAST = settings(max_examples=300, deadline=None)


@st.composite
def instances(draw: st.DrawFn, max_items: int = 60) -> dict:
    pack_size = draw(st.sampled_from([1, 7, 16, 64, 100, 1000]))
    top = pack_size + pack_size // 4 + 1
    return {
        "lengths": np.array(draw(st.lists(st.integers(1, top), max_size=max_items)), dtype=np.int64),
        "pack_size": pack_size,
        "max_samples_per_pack": draw(st.none() | st.integers(1, 6)),
        "pad_to_multiple_of": draw(st.sampled_from([1, 1, 2, 4, 8])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def slots_of(lengths: np.ndarray, pad: int) -> np.ndarray:
    return (lengths + pad - 1) // pad * pad


def packs_of(plan: PackAssignment) -> list[tuple[int, ...]]:
    return [tuple(plan.pack(p).tolist()) for p in range(plan.num_packs)]


def reference_bfd(slots: list[int], pack_size: int, cap: int | None) -> list[tuple[int, ...]]:
    """Plain best-fit decreasing: least room that fits; ties go to the pack touched last."""
    order = sorted((i for i, s in enumerate(slots) if s <= pack_size), key=lambda i: -slots[i])
    packs: list[dict] = []
    for step, i in enumerate(order):
        fits = [p for p in packs if p["room"] >= slots[i] and len(p["items"]) < (cap or 10**9)]
        if fits:
            best = min(fits, key=lambda p: (p["room"], -p["touched"]))
        else:
            best = {"room": pack_size, "items": []}
            packs.append(best)
        best["items"].append(i)
        best["room"] -= slots[i]
        best["touched"] = step
    return [tuple(p["items"]) for p in packs]


def reference_ffd_count(sizes: list[int], capacity: int) -> int:
    loads: list[int] = []
    for s in sorted(sizes, reverse=True):
        for b, load in enumerate(loads):
            if load + s <= capacity:
                loads[b] += s
                break
        else:
            loads.append(s)
    return len(loads)


def optimum(sizes: list[int], capacity: int) -> int:
    """Exact minimum packs: DP over subsets keeping the lexicographically least (packs, fill)."""
    n = len(sizes)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (0, capacity)  # "previous pack full" so the first item opens one
    for mask in range(1 << n):
        packs, fill = best[mask]
        for i in range(n):
            if not mask >> i & 1:
                step = (packs, fill + sizes[i]) if fill + sizes[i] <= capacity else (packs + 1, sizes[i])
                best[mask | 1 << i] = min(best[mask | 1 << i], step)
    return best[-1][0]


@FAST
@given(instances())
def test_plan_keeps_every_invariant(case: dict) -> None:
    plan = plan_packs(**case)
    lengths, pack_size = case["lengths"], case["pack_size"]
    slots = slots_of(lengths, case["pad_to_multiple_of"])
    packs = packs_of(plan)
    assert all(slots[list(p)].sum() <= pack_size for p in packs)
    assert all(0 < len(p) <= (case["max_samples_per_pack"] or len(lengths)) for p in packs)
    placed = sorted(itertools.chain(*packs, plan.oversize.tolist()))
    assert placed == list(range(len(lengths)))
    assert plan.oversize.tolist() == np.flatnonzero(slots > pack_size).tolist()
    assert np.array_equal(plan.slot_lengths, slots)
    packed = list(itertools.chain(*packs))
    assert plan.num_tokens == lengths[packed].sum()
    assert plan.slot_tokens == slots[packed].sum()
    assert plan.efficiency == (plan.num_tokens / (plan.num_packs * pack_size) if packs else 0.0)
    assert plan.lb2 <= plan.num_packs
    verify_plan(plan, lengths, pack_size)


@FAST
@given(instances(max_items=80))
def test_bfd_matches_plain_python_reference(case: dict) -> None:
    plan = plan_packs(**case)
    slots = slots_of(case["lengths"], case["pad_to_multiple_of"]).tolist()
    expected = reference_bfd(slots, case["pack_size"], case["max_samples_per_pack"])
    assert sorted(packs_of(plan)) == sorted(expected)


@FAST
@given(instances(max_items=120))
def test_same_inputs_same_plan_and_seed_moves_only_order(case: dict) -> None:
    first, again = plan_packs(**case), plan_packs(**case)
    for field in ("pack_offsets", "item_order", "oversize", "slot_lengths"):
        assert np.array_equal(getattr(first, field), getattr(again, field))
    other = plan_packs(**{**case, "seed": case["seed"] + 1})
    assert sorted(packs_of(other)) == sorted(packs_of(first))


@FAST
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=200), st.integers(0, 10**6))
def test_pack_count_close_to_ffd(lengths: list[int], seed: int) -> None:
    # BFD is not always <= FFD (see the regression test below); +1 never broke in 100k
    # random instances of up to 200 items, and both sit within 0.01 % of LB2 at scale.
    plan = plan_packs(np.array(lengths), pack_size=1000, seed=seed)
    ffd_packs = ffd_pack(np.array(lengths), 1000)[1]
    assert ffd_packs == reference_ffd_count(lengths, 1000)
    assert plan.num_packs <= ffd_packs + 1


def test_bfd_can_lose_to_ffd_regression() -> None:
    # Why the FFD property above has slack: here FFD finds the optimum (2), BFD needs 3.
    lengths = np.array([68, 45, 28, 16, 11, 10, 7])
    assert ffd_pack(lengths, 95)[1] == optimum(lengths.tolist(), 95) == 2
    assert plan_packs(lengths, pack_size=95).num_packs == 3


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20).flatmap(lambda c: st.tuples(st.just(c), st.lists(st.integers(1, c), min_size=1, max_size=8))))
def test_bounds_below_exact_optimum(case: tuple[int, list[int]]) -> None:
    capacity, sizes = case
    opt = optimum(sizes, capacity)
    l1, l2 = lower_bound_l1(np.array(sizes), capacity), lower_bound_l2(np.array(sizes), capacity)
    packs = plan_packs(np.array(sizes), pack_size=capacity).num_packs
    assert l1 <= l2 <= opt <= packs
    assert 2 * packs <= 3 * opt  # BFD's absolute worst-case ratio is 3/2 (Simchi-Levi 1994)


def test_l2_counts_items_over_half() -> None:
    assert lower_bound_l1(np.array([6, 6, 6, 2]), 10) == 2
    assert lower_bound_l2(np.array([6, 6, 6, 2]), 10) == 3
    assert lower_bound_l2(np.array([], dtype=np.int64), 10) == 0


@FAST
@given(st.lists(st.integers(1, 12), max_size=300))
def test_counting_sort_is_stable_descending(values: list[int]) -> None:
    array = np.array(values, dtype=np.int64)
    assert counting_sort_desc(array, 12).tolist() == np.argsort(-array, kind="stable").tolist()


@FAST
@given(
    st.lists(st.tuples(st.integers(1, 500), st.integers(0, 300)), min_size=1, max_size=150),
    st.integers(1, 5),
    st.integers(0, 10**6),
)
def test_balance_media_groups_similar_loads(rows: list, group: int, seed: int) -> None:
    lengths, media = np.array(rows).T
    plan = plan_packs(
        lengths,
        pack_size=1000,
        seed=seed,
        media_tokens=media,
        balance_media=True,
        media_group_size=group,
    )
    plain = plan_packs(lengths, pack_size=1000, seed=seed)
    assert sorted(packs_of(plan)) == sorted(packs_of(plain))
    loads = [int(media[list(p)].sum()) for p in packs_of(plan)]
    full = len(loads) // group * group
    groups = sorted(sorted(loads[g : g + group]) for g in range(0, full, group))
    for lighter, heavier in itertools.pairwise(groups):
        assert lighter[-1] <= heavier[0]
    if groups and full < len(loads):
        assert min(loads[full:]) >= groups[-1][-1]


def test_docstring_example() -> None:
    lengths = np.array([300, 900, 500, 200, 700, 100, 400, 800])
    plan = plan_packs(lengths, pack_size=1000, seed=0)
    assert plan.pack_offsets.tolist() == [0, 2, 3, 5, 8]
    assert plan.item_order.tolist() == [4, 0, 1, 7, 3, 2, 6, 5]
    assert (plan.num_packs, plan.lb2, plan.num_tokens, plan.efficiency) == (4, 4, 3900, 0.975)


def test_verify_names_broken_invariants() -> None:
    lengths = np.array([300, 900, 500, 200, 700, 100, 400, 800])
    plan = plan_packs(lengths, pack_size=1000, max_samples_per_pack=3)
    with pytest.raises(PlanInvariantError, match="slot tokens > pack_size 999"):
        verify_plan(plan, lengths, 999)
    doubled = plan.item_order.copy()
    doubled[0] = doubled[1]
    with pytest.raises(PlanInvariantError, match="placed 2 times"):
        verify_plan(dataclasses.replace(plan, item_order=doubled), lengths, 1000)
    with pytest.raises(PlanInvariantError, match="max_samples_per_pack 2"):
        verify_plan(dataclasses.replace(plan, max_samples_per_pack=2), lengths, 1000)
    with pytest.raises(PlanInvariantError, match="rounded up"):
        verify_plan(plan, lengths + 1, 1000)
    spilled = plan_packs(np.array([1200, 300]), pack_size=1000)
    assert spilled.oversize.tolist() == [0]
    with pytest.raises(PlanInvariantError, match="marked oversize"):
        verify_plan(spilled, np.array([1200, 300]), 2000)


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="lengths"):
        plan_packs(np.array([3, 0]), pack_size=10)
    with pytest.raises(ValueError, match="pack_size"):
        plan_packs(np.array([3]), pack_size=0)
    with pytest.raises(ValueError, match="media_tokens"):
        plan_packs(np.array([3]), pack_size=10, balance_media=True)


@FAST
@given(st.lists(st.integers(1, 100), max_size=300), st.integers(1, 40))
def test_baselines_pack_validly(lengths: list[int], window: int) -> None:
    array = np.array(lengths, dtype=np.int64)
    results = [
        ffd_pack(array, 100),
        next_fit_pack(array, 100),
        windowed_ffd_pack(array, 100, window),
        heap_worst_fit_pack(array, 100),
    ]
    for pack_of, num in results:
        loads = np.bincount(pack_of, weights=array, minlength=num)
        assert pack_of.size == array.size and loads.size == num
        assert loads.max(initial=0) <= 100 and (loads > 0).all()
    assert results[0][1] == reference_ffd_count(lengths, 100)
