"""Seeded `plan_packs` inputs and a digest of each plan, to pin a rewrite of the packer to the
plans of the version before it (recorded in ``recorded_plans.json`` at commit eee7b14).

Every array is digested as int64, so a rewrite may change dtypes but not one value or order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from prep.pack.assignment import PackAssignment

RECORDING = Path(__file__).parent / "recorded_plans.json"
NUM_CASES = 160


def case(index: int) -> dict[str, Any]:
    """Keyword arguments of `plan_packs` for case ``index``: sizes, caps, padding, oversize, media."""
    rng = np.random.default_rng(index)
    pack_size = int(rng.choice([1, 7, 16, 64, 100, 1000, 4096, 8192]))
    n = int(rng.choice([0, 1, 5, 60, 1000, 20_000]))
    if rng.random() < 0.5:
        lengths = rng.integers(1, pack_size + pack_size // 4 + 2, n)
    else:
        lengths = np.clip(np.exp(rng.normal(np.log(max(1, pack_size / 12)), 1.0, n)), 1, 1.1 * pack_size + 1)
    balance = bool(rng.random() < 0.25)
    return {
        "lengths": lengths.astype(rng.choice([np.int64, np.int32])),
        "pack_size": pack_size,
        "max_samples_per_pack": None if rng.random() < 0.6 else int(rng.choice([1, 2, 3, 6, 64])),
        "pad_to_multiple_of": int(rng.choice([1, 1, 1, 2, 4, 8])),
        "seed": int(rng.integers(0, 2**32)),
        "media_tokens": rng.integers(0, 2000, n) if balance else None,
        "balance_media": balance,
        "media_group_size": int(rng.choice([1, 3, 8])),
    }


def digest(plan: PackAssignment) -> dict[str, Any]:
    """The plan's arrays (as int64) hashed, its numbers kept."""
    arrays = hashlib.sha256()
    for name in ("pack_offsets", "item_order", "oversize", "slot_lengths"):
        arrays.update(name.encode() + np.ascontiguousarray(getattr(plan, name), dtype=np.int64).tobytes())
    return {
        "arrays_sha256": arrays.hexdigest(),
        "num_packs": plan.num_packs,
        "lb2": plan.lb2,
        "num_tokens": plan.num_tokens,
        "slot_tokens": plan.slot_tokens,
        "efficiency": repr(plan.efficiency),
    }


def record() -> None:
    """Write the digests of the current `plan_packs` (run once, before a rewrite)."""
    from prep.pack.core import plan_packs

    RECORDING.write_text(json.dumps([digest(plan_packs(**case(i))) for i in range(NUM_CASES)], indent=1) + "\n")


if __name__ == "__main__":
    record()
