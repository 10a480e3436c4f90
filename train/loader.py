"""Energon's savable loader over a packed dataset, yielding `PackedBatch` micro-batches.

One call builds what every loop needs: the dataset is validated first (`train.dataset`), then
``get_train_dataset`` with `PackedBatchTaskEncoder` (``batch_size`` = packs per micro-batch)
is wrapped in ``get_savable_loader``. Data-parallel ranks read disjoint packs: Energon splits
the split's packs into ``world_size x max(1, num_workers)`` contiguous ranges, one per global
worker, so a dataset with fewer packs than that is refused up front (some worker would get
none). With ``repeat=False`` ranks may end a few micro-batches apart (ranges differ by one
pack); training loops use ``repeat=True``.

Sampling (``LoaderConfig.sampling``):

- ``"epoch"`` (default): every pack exactly once per epoch across all ranks and workers, in
  an order that differs per epoch. Each global worker walks a fresh seeded permutation of its
  own packs per epoch (Energon: slices of one pack, ``max_samples_per_sequence=1``, shuffled
  without replacement over one epoch, ``shuffle_over_epochs_multiplier=1``), and no sample
  buffer mixes one epoch into the next (``shuffle_buffer_size=None``). The loader takes one
  micro-batch from each worker in turn and ranks step together, so after ``num_packs``
  packs consumed every worker has finished exactly one epoch. Exact when ``num_packs``
  divides by ranks x workers; otherwise worker ranges differ by one pack, each worker's
  epochs stay exact, and packs of the shorter ranges come round a little more often (logged).
- ``"buffer"``: Energon's streaming default as before: slices of ``max_samples_per_sequence``
  packs read in parallel and a shuffle buffer of ``shuffle_buffer_size`` packs, which lets
  epochs overlap (some packs twice before others once).

Shuffling draws from Energon's worker RNG, seeded from ``WorkerConfig.seed_offset`` =
``LoaderConfig.seed`` and the global worker id: the same seed, ranks and workers give the same
micro-batches. Loader state for checkpoints::

    state = loader_state(loader)                 # bytes, per rank; store beside the model
    loader = make_loader(config, state=state)    # a fresh loader continuing where it stopped
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from megatron.energon import SavableDataLoader, WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.errors import reraise_exception

from packvlm.energon import quiet_pin_memory_without_accelerator
from train.dataset import PackedDatasetInfo, TrainConfigError, open_packed_dataset
from train.encoder import PackedBatchTaskEncoder
from train.identity import ModelConfigSource
from train.media import PIXEL_WIRES, PixelWire

log = logging.getLogger(__name__)
Sampling = Literal["epoch", "buffer"]
SAMPLINGS: tuple[Sampling, ...] = ("epoch", "buffer")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderConfig:
    """Everything that decides which micro-batches a rank sees, in which order."""

    data: str  # `prep pack` output indexed by `prep energon-index`
    processor: str  # processor directory / hub id (the one the data was tokenized with)
    model: ModelConfigSource  # model directory (config.json; weights not read) or a config object
    rank: int = 0  # data-parallel rank
    world_size: int = 1  # data-parallel size
    num_workers: int = 2  # loader worker processes per rank (0: in the main process)
    packs_per_microbatch: int = 1
    seed: int = 0
    sampling: Sampling = "epoch"  # every pack once per epoch; "buffer": Energon's streaming shuffle
    shuffle_buffer_size: int | None = 100  # "buffer" only
    max_samples_per_sequence: int | None = 100  # "buffer" only
    repeat: bool = True
    split: str = "train"
    context_parallel_size: int = 1  # slots must be multiples of 2x this (checked when the dataset opens)
    pixels: PixelWire = "uint8"  # image pixels from the workers: 8-bit, normalised in the step; or float32

    def worker_config(self) -> WorkerConfig:
        """Energon's view of this rank; errors re-raised so no pack is ever skipped silently."""
        return WorkerConfig(
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.num_workers,
            seed_offset=self.seed,
            global_error_handler=reraise_exception,
        )


class LoaderOptions(Protocol):
    """The data flags both `train` recipes share (their configs carry these fields)."""

    @property
    def data(self) -> Path: ...
    @property
    def processor(self) -> Path: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def packs_per_microbatch(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def sampling(self) -> Sampling: ...
    @property
    def pixels(self) -> PixelWire: ...
    @property
    def shuffle_buffer_size(self) -> int: ...


def rank_loader_config(
    options: LoaderOptions,
    *,
    model: ModelConfigSource,
    rank: int,
    world_size: int,
    context_parallel_size: int = 1,
) -> LoaderConfig:
    """The loader of one data-parallel rank of a `train` recipe: the one place a recipe's flags become a loader.

    Args:
        options: The recipe's config (`LoaderOptions` fields).
        model: Model directory whose config.json gives the rope rule (weights never read).
        rank: Data-parallel rank (context-parallel peers pass the same rank: they read the same packs).
        world_size: Data-parallel size.
        context_parallel_size: Slots must be multiples of 2x this (checked when the dataset opens).
    """
    return LoaderConfig(
        data=str(options.data),
        processor=str(options.processor),
        model=model,
        rank=rank,
        world_size=world_size,
        num_workers=options.num_workers,
        packs_per_microbatch=options.packs_per_microbatch,
        seed=options.seed,
        sampling=options.sampling,
        shuffle_buffer_size=options.shuffle_buffer_size,
        context_parallel_size=context_parallel_size,
        pixels=options.pixels,
    )


def validate_loader_config(config: LoaderConfig) -> PackedDatasetInfo:
    """Check ranks, sizes and the dataset; `TrainConfigError` names what to change."""
    if config.world_size < 1 or not 0 <= config.rank < config.world_size:
        raise TrainConfigError(f"rank {config.rank} is not in 0..world_size-1 (world_size {config.world_size})")
    if config.num_workers < 0 or config.packs_per_microbatch < 1:
        raise TrainConfigError(
            f"num_workers {config.num_workers} must be >= 0 and packs_per_microbatch {config.packs_per_microbatch} >= 1"
        )
    if config.pixels not in PIXEL_WIRES:
        raise TrainConfigError(f"pixels {config.pixels!r} is not one of {', '.join(PIXEL_WIRES)}")
    if config.sampling not in SAMPLINGS:
        raise TrainConfigError(f"sampling {config.sampling!r} is not one of {', '.join(SAMPLINGS)}")
    workers = config.world_size * max(1, config.num_workers)
    info = open_packed_dataset(
        config.data,
        config.processor,
        model=config.model,
        split=config.split,
        min_packs=workers,
        cp_size=config.context_parallel_size,
    )
    if config.sampling == "epoch" and info.num_packs % workers and config.rank == 0:
        log.info(uneven_epoch_note(info.num_packs, workers))
    return info


def uneven_epoch_note(num_packs: int, workers: int) -> str:
    """What an epoch means when ``workers`` (ranks x loader workers) do not divide ``num_packs``.

    Informational, not a fault: each worker's range is read exactly once per its own epoch, and the
    longer ranges hold one pack more, so packs of the shorter ranges come round a little more often.
    """
    low, extra = divmod(num_packs, workers)
    return (
        f"{num_packs} packs over {workers} data-parallel workers (ranks x loader workers): {extra} read {low + 1} "
        f"packs per epoch and {workers - extra} read {low}, so the packs of the shorter ranges come round "
        f"{(low + 1) / low:.2f}x as often over a long run; a pack count divisible by {workers} evens this out"
    )


def make_loader(config: LoaderConfig, *, state: bytes | None = None, validate: bool = True) -> SavableDataLoader:
    """Energon's savable loader yielding `PackedBatch` (``packs_per_microbatch`` packs each).

    Args:
        config: What this rank reads.
        state: `loader_state` of a loader with the same config, to continue where it stopped.
        validate: Check the dataset and sizes first (`validate_loader_config`).
    """
    if validate:
        validate_loader_config(config)
    per_epoch = config.sampling == "epoch"
    dataset = get_train_dataset(
        config.data,
        split_part=config.split,
        worker_config=config.worker_config(),
        batch_size=config.packs_per_microbatch,
        shuffle_buffer_size=None if per_epoch else config.shuffle_buffer_size,
        max_samples_per_sequence=1 if per_epoch else config.max_samples_per_sequence,
        shuffle_over_epochs_multiplier=1,
        task_encoder=PackedBatchTaskEncoder(config.processor, config.model, config.pixels),
        repeat=config.repeat,
    )
    quiet_pin_memory_without_accelerator()
    loader = get_savable_loader(dataset)
    if state is not None:
        loader.restore_state_rank(pickle.loads(state))
    return loader


def loader_state(loader: SavableDataLoader) -> bytes:
    """This rank's loader position as bytes (pickle of Energon's state) for a checkpoint."""
    return pickle.dumps(loader.save_state_rank())


def restore_loader(config: LoaderConfig, state: bytes | None) -> SavableDataLoader:
    """A fresh loader for ``config`` continuing from ``state`` (None: from the start)."""
    return make_loader(config, state=state)
