"""The packs of a split as one global stream, whatever the number of ranks: elastic resume.

With ``--sampling epoch`` every rank reads from one stream: epoch ``e`` is a permutation of
the split's packs that depends only on (``seed``, ``e``, the number of packs), the epochs
follow one another, and the stream position is the number of packs all ranks together have
consumed. Micro-batch ``j`` of rank ``r`` (counted from the position ``start`` the loader was
opened at) holds stream positions::

    start + (j * world_size + r) * packs_per_microbatch  ...  + packs_per_microbatch - 1

Worked example, 10 packs, 2 ranks, 1 pack per micro-batch, grad_accum 1; epoch 0's order
``[7 2 9 0 4 1 8 3 6 5]``: step 1 reads packs 7 (rank 0) and 2 (rank 1), step 2 9 and 0, ...
After 3 steps the position is 6. Resumed on one rank it reads 8, 3, 6, 5 (the rest of epoch
0) and then epoch 1's order: every pack of the epoch once, whatever happened in between.

Ranks step together, so after any optimizer step the packs consumed are exactly a prefix of
the stream, and one integer (`DataPosition`) is the whole loader state: a checkpoint records
it once, not per rank, and a run resumed on any number of ranks takes its slice of the rest.
Packs are read by index through Energon's indexed-tar reader (``.tar.idx``), decoded by the
shipped cooker (`packvlm.energon.cook_pack`) and encoded by `train.encoder.PackEncoder` in
torch ``DataLoader`` workers, delivered in order.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.config import SPLIT_YAML_FILENAME
from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

from packvlm.energon import cook_pack
from train.batch import PackedBatch, concat_batches
from train.dataset import TrainConfigError
from train.encoder import PackedBatchTaskEncoder

SEED_MASK = (1 << 64) - 1  # numpy seed sequences take non-negative integers


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPosition:
    """How far the global stream has been read: all the loader state a checkpoint needs."""

    consumed: int  # packs of the stream read by all ranks together
    num_packs: int  # packs per epoch (the split's size)
    seed: int  # the order's seed

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_packs

    @property
    def offset(self) -> int:
        """Packs of the current epoch already read."""
        return self.consumed % self.num_packs

    def to_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "num_packs": self.num_packs, "seed": self.seed}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DataPosition:
        return cls(consumed=int(raw["consumed"]), num_packs=int(raw["num_packs"]), seed=int(raw["seed"]))

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> DataPosition:
        return cls.from_dict(json.loads(raw))


def epoch_order(seed: int, epoch: int, num_packs: int) -> np.ndarray:
    """Epoch ``epoch``'s permutation of pack indices 0..num_packs-1 (no rank or worker in it)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & SEED_MASK, epoch])))
    return rng.permutation(num_packs)


class GlobalOrder:
    """Stream position -> pack index, one cached permutation per epoch."""

    def __init__(self, seed: int, num_packs: int) -> None:
        self.seed = seed
        self.num_packs = num_packs
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def pack_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_packs)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.seed, epoch, self.num_packs)
        return int(self._order[offset])


def microbatch_positions(start: int, index: int, *, rank: int, world_size: int, packs: int, end: int | None) -> range:
    """Stream positions of micro-batch ``index`` of ``rank`` (see the module docstring); cut at ``end``."""
    first = start + (index * world_size + rank) * packs
    last = first + packs if end is None else min(first + packs, end)
    return range(first, max(first, last))


class GlobalOrderDataset(torch.utils.data.Dataset[PackedBatch]):
    """Micro-batch ``j`` of one rank, read by pack index; the reader opens lazily in each worker."""

    def __init__(
        self,
        root: str,
        split: str,
        encoder: PackedBatchTaskEncoder,
        *,
        start: DataPosition,
        rank: int,
        world_size: int,
        packs_per_microbatch: int,
        end: int | None,
    ) -> None:
        self.root, self.split, self.encoder = root, split, encoder
        self.start, self.rank, self.world_size = start, rank, world_size
        self.packs, self.end = packs_per_microbatch, end
        self._reader: ShardInfosITarReader | None = None
        self._order = GlobalOrder(start.seed, start.num_packs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # open files never cross a process boundary
        return state

    def positions(self, index: int) -> range:
        return microbatch_positions(
            self.start.consumed, index, rank=self.rank, world_size=self.world_size, packs=self.packs, end=self.end
        )

    def __getitem__(self, index: int) -> PackedBatch:
        if self._reader is None:
            self._reader = open_reader(self.root, self.split)
        encoder = self.encoder.encoder
        packs = []
        for position in self.positions(index):
            raw = self._reader[self._order.pack_index(position)]
            if raw is None:  # only a sample filter returns None, and we set none
                raise TrainConfigError(f"{self.root}: pack at index {self._order.pack_index(position)} is excluded")
            packs.append(encoder.encode(cook_pack(dict(raw)).pack))
        return concat_batches(packs, encoder.joins)


def split_shards(root: str, split: str) -> WebdatasetMeta:
    """Energon's shard list of ``split`` (its order numbers the packs 0..N-1)."""
    meta = WebdatasetMeta.from_config(path=EPath(root), split_part=split, split_config=SPLIT_YAML_FILENAME)
    if meta.sample_excludes:
        raise TrainConfigError(
            f"--data {root}: split.yaml excludes {len(meta.sample_excludes)} packs; --sampling epoch reads every "
            f"pack of {split!r}: re-run `prep energon-index {root}` without excludes, or use --sampling buffer"
        )
    return meta


def open_reader(root: str, split: str) -> ShardInfosITarReader:
    """Random access by pack index over the split's shards (Energon's ``.tar.idx`` offsets)."""
    return ShardInfosITarReader(EPath(root), split_shards(root, split).shards)


class GlobalOrderLoader:
    """One rank's micro-batches of the global stream; `position` is exact after every micro-batch taken.

    Iterating again continues after the last micro-batch handed out (prefetched ones are read again);
    ``next(loader)`` draws from one running iteration.
    """

    def __init__(
        self,
        root: str,
        split: str,
        encoder: PackedBatchTaskEncoder,
        *,
        start: DataPosition,
        rank: int,
        world_size: int,
        packs_per_microbatch: int,
        num_workers: int,
        repeat: bool,
    ) -> None:
        self.root, self.split, self.encoder = root, split, encoder
        self.rank, self.world_size, self.packs = rank, world_size, packs_per_microbatch
        self.num_workers, self.repeat = num_workers, repeat
        self._start = start
        # without repeat: the rest of the epoch the loader opened in
        self._end = None if repeat else (start.epoch + 1) * start.num_packs
        self._taken = 0  # micro-batches handed out by this rank since `start`
        self._running: Iterator[PackedBatch] | None = None  # the iteration `next(loader)` draws from

    def position(self) -> DataPosition:
        """The global position once every rank has taken as many micro-batches as this one."""
        consumed = self._start.consumed + self._taken * self.world_size * self.packs
        if self._end is not None:
            consumed = min(consumed, self._end)
        return DataPosition(consumed=consumed, num_packs=self._start.num_packs, seed=self._start.seed)

    def _indices(self) -> Iterator[int]:
        counter = itertools.count(self._taken)
        if self._end is None:
            return counter
        start, end = self._start.consumed, self._end
        return itertools.takewhile(
            lambda j: start + (j * self.world_size + self.rank) * self.packs < end,
            counter,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        dataset = GlobalOrderDataset(
            self.root,
            self.split,
            self.encoder,
            start=self._start,
            rank=self.rank,
            world_size=self.world_size,
            packs_per_microbatch=self.packs,
            end=self._end,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            sampler=_Indices(self._indices()),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),  # as Energon's loader: `PackedBatch.to` copies non-blocking
        )
        for batch in loader:
            self._taken += 1
            yield batch

    def __next__(self) -> PackedBatch:
        """``next(loader)`` as on Energon's loader: one running iteration, started on first use."""
        if self._running is None:
            self._running = iter(self)
        return next(self._running)


class _Indices(torch.utils.data.Sampler[int]):
    """A one-pass sampler over an iterator of micro-batch indices (possibly endless)."""

    def __init__(self, indices: Iterator[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return self.indices
