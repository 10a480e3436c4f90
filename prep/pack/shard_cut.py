"""Which packs go to which shard: consecutive runs of the plan order, cut by size (part of the plan).

``--shard-size`` is either bytes (``512MB``, ``1GiB``, ``4096``) or packs (``1000packs``).
Byte cuts use an estimate known before writing (tar headers + arrays + the media byte sizes
recorded at tokenize time + a json allowance), so a shard may end a little past the target; every shard holds at least
one pack, so none is empty.

Example: estimated pack bytes [300, 300, 300, 300, 300], shard size 700 bytes ->
offsets [0, 2, 4, 5]: shards of packs [0, 1], [2, 3], [4].

With splits (`cut_split_shards`), cutting restarts at each split boundary so no shard spans
two splits: the same packs with splits train = packs [0, 3), val = [3, 5) -> offsets
[0, 2, 3, 5], shard splits (train, train, val).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from packvlm.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
TAR_BLOCK = 512
NPY_HEADER = 128
META_BASE = 400  # json allowance per pack
META_PER_SAMPLE = 160
META_PER_MEDIA = 320


class ShardSizeError(UsageError, ValueError):  # a usage error: raised while parsing the option
    """``--shard-size`` is not bytes (``512MB``) or packs (``1000packs``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSize:
    """Target shard size: exactly one of ``max_bytes`` and ``max_packs`` is set."""

    max_bytes: int | None = None
    max_packs: int | None = None

    def __str__(self) -> str:
        return f"{self.max_packs}packs" if self.max_packs else f"{self.max_bytes}B"


def parse_shard_size(text: str) -> ShardSize:
    """Parse ``512MB`` / ``1.5GiB`` / ``4096`` (bytes) or ``1000packs``."""
    m = _SIZE.match(text.lower())
    if not m:
        raise ShardSizeError(f"--shard-size {text!r}: use bytes like 512MB or packs like 1000packs")
    number, unit = m.groups()
    if unit in ("packs", "pack"):
        if "." in number or int(number) < 1:
            raise ShardSizeError(f"--shard-size {text!r}: packs must be a whole number >= 1")
        return ShardSize(max_packs=int(number))
    if unit == "":
        raise ShardSizeError(f"--shard-size {text!r} needs a unit: bytes like {number}MB / {number}B, or {number}packs")
    if unit not in _UNITS:
        raise ShardSizeError(f"--shard-size {text!r}: unknown unit {unit!r}; use B, KB, MB, GB, KiB, MiB, GiB or packs")
    size = int(float(number) * _UNITS[unit])
    if size < 1:
        raise ShardSizeError(f"--shard-size {text!r} must be > 0")
    return ShardSize(max_bytes=size)


def _tar_member(nbytes: np.ndarray) -> np.ndarray:
    return TAR_BLOCK + -(-nbytes // TAR_BLOCK) * TAR_BLOCK


def estimate_pack_bytes(
    pack_offsets: np.ndarray,
    item_order: np.ndarray,
    num_tokens: np.ndarray,
    media_bytes: np.ndarray,
    media_count: np.ndarray,
) -> np.ndarray:
    """Estimated tar bytes of every pack (CSR plan order; arrays exact, json approximate)."""
    if pack_offsets.size < 2:
        return np.zeros(0, np.int64)
    items, starts = item_order, pack_offsets[:-1]
    tokens = np.add.reduceat(num_tokens[items], starts)
    media = np.add.reduceat(media_bytes[items] + media_count[items] * TAR_BLOCK, starts)
    n_media = np.add.reduceat(media_count[items], starts)
    n_samples = np.diff(pack_offsets)
    meta = META_BASE + META_PER_SAMPLE * n_samples + META_PER_MEDIA * n_media
    arrays = _tar_member(NPY_HEADER + 4 * tokens) + _tar_member(NPY_HEADER + tokens)
    return (arrays + _tar_member(meta) + media).astype(np.int64)


def cut_shards(pack_bytes: np.ndarray, size: ShardSize) -> np.ndarray:
    """Shard offsets into the pack order: shard s holds packs [offsets[s], offsets[s+1])."""
    n = int(pack_bytes.size)
    if size.max_packs is not None:
        return np.append(np.arange(0, n, size.max_packs), n).astype(np.int64) if n else np.zeros(1, np.int64)
    limit = int(size.max_bytes or 0)
    offsets, acc = [0], 0
    for p, nbytes in enumerate(pack_bytes.tolist()):
        if acc and acc + nbytes > limit:
            offsets.append(p)
            acc = 0
        acc += nbytes
    if n:
        offsets.append(n)
    return np.asarray(offsets, np.int64)


def cut_split_shards(
    pack_bytes: np.ndarray, size: ShardSize, split_offsets: tuple[int, ...], split_names: tuple[str, ...]
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Shard offsets cut within each split (packs [split_offsets[i], split_offsets[i+1]) are split i),
    and the split of every shard; an empty split has no shard. One split gives `cut_shards` exactly."""
    offsets, names = [np.zeros(1, np.int64)], []
    for name, first, end in zip(split_names, split_offsets, split_offsets[1:]):
        if end > first:
            cut = cut_shards(pack_bytes[first:end], size)[1:] + first
            offsets.append(cut)
            names += [name] * int(cut.size)
    return np.concatenate(offsets), tuple(names)
