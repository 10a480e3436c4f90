"""The packer's result in memory: samples grouped into packs, in CSR form."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PackAssignment:
    """Which samples share a pack (in memory; `prep pack` writes it as schemas.plan rows).

    Arrays are read-only.

    Attributes:
        pack_size: Capacity of a pack in tokens.
        pad_to_multiple_of: Slot rounding; slots, not lengths, occupy capacity.
        max_samples_per_pack: Cap on samples per pack, or None.
        seed: Seed of the pack-order shuffle.
        pack_offsets: CSR offsets into `item_order`, length num_packs + 1.
        item_order: Sample indices, pack by pack, longest slot first within a pack (int32 below
            2^31 samples: at 100M samples every byte per sample is 100 MB).
        oversize: Ascending indices of samples whose slot exceeds `pack_size`.
        slot_lengths: Slot length of every input sample (oversize ones included); with no
            padding, a read-only view of the caller's lengths, not a copy.
        num_packs: Packs in the plan.
        lb2: Martello-Toth L2 lower bound on packs (raised to ceil(n / cap) under a cap).
        num_tokens: Real tokens of the packed samples.
        slot_tokens: Slot tokens of the packed samples (real + pad rounding).
        efficiency: num_tokens / (num_packs * pack_size); 0.0 for an empty plan.
    """

    pack_size: int
    pad_to_multiple_of: int
    max_samples_per_pack: int | None
    seed: int
    pack_offsets: np.ndarray
    item_order: np.ndarray
    oversize: np.ndarray
    slot_lengths: np.ndarray
    num_packs: int
    lb2: int
    num_tokens: int
    slot_tokens: int
    efficiency: float

    def pack(self, p: int) -> np.ndarray:
        """Sample indices of pack `p`."""
        return self.item_order[self.pack_offsets[p] : self.pack_offsets[p + 1]]
