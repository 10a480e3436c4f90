"""Plan invariants, checked before a plan is written: overflow, conservation, cap.

Cheap (vectorised numpy, O(n)) so every run can afford it; a failure raises
`PlanInvariantError` naming the first bad pack or sample.
"""

from __future__ import annotations

import numpy as np

from packvlm.errors import InternalError
from prep.pack.assignment import PackAssignment
from schemas.plan import slot_tokens


class PlanInvariantError(InternalError, ValueError):
    """A plan breaks an invariant (overflow, lost or repeated sample, cap): do not write it."""


def verify_plan(plan: PackAssignment, lengths: np.ndarray, pack_size: int) -> None:
    """Re-check a plan against its lengths before anything is written; vectorised, O(n).

    Raises:
        PlanInvariantError: Names the first bad pack or sample and what to do.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n, unit, slots = lengths.size, plan.pad_to_multiple_of, plan.slot_lengths
    if slots.shape != (n,) or np.any(slots != slot_tokens(lengths, unit)):
        raise PlanInvariantError(
            f"slot_lengths differ from lengths rounded up to {unit}: the plan was made from "
            "other lengths; rebuild it from this length column"
        )
    offsets, items = plan.pack_offsets, plan.item_order
    sizes = np.diff(offsets)
    if offsets.size != plan.num_packs + 1 or offsets[0] != 0 or offsets[-1] != items.size or np.any(sizes < 1):
        raise PlanInvariantError("pack_offsets are not CSR offsets of non-empty packs: rebuild")
    placed = np.concatenate([items, plan.oversize])
    if placed.size and (placed.min() < 0 or placed.max() >= n):
        raise PlanInvariantError(f"plan names samples outside [0, {n}): wrong length column")
    seen = np.bincount(placed, minlength=n)
    wrong = np.flatnonzero(seen != 1)
    if wrong.size:
        i = int(wrong[0])
        raise PlanInvariantError(
            f"sample {i} is placed {int(seen[i])} times, expected once (in a pack or in "
            "oversize): the plan is corrupt; rebuild it"
        )
    if plan.num_packs:
        loads = np.add.reduceat(slots[items], offsets[:-1])
        over = np.flatnonzero(loads > pack_size)
        if over.size:
            p = int(over[0])
            raise PlanInvariantError(
                f"pack {p} holds {int(loads[p])} slot tokens > pack_size {pack_size} "
                f"(samples {plan.pack(p).tolist()}): replan with pack_size={pack_size}"
            )
    cap = plan.max_samples_per_pack
    if cap is not None and sizes.size and sizes.max() > cap:
        p = int(np.argmax(sizes))
        raise PlanInvariantError(f"pack {p} holds {int(sizes[p])} samples > max_samples_per_pack {cap}: replan")
    fits = plan.oversize[slots[plan.oversize] <= pack_size]
    if fits.size:
        raise PlanInvariantError(
            f"sample {int(fits[0])} is marked oversize but its slot fits pack_size "
            f"{pack_size}: replan with this pack_size"
        )
