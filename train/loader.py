"""Energon's savable loader over a packed dataset, yielding `PackedBatch` micro-batches.

One call builds what every loop needs: the dataset is validated first (`train.dataset`), then
a loader of `PackedBatch` micro-batches (``packs_per_microbatch`` packs each) encoded by
`PackedBatchTaskEncoder` in worker processes. Data-parallel ranks read disjoint packs; a
dataset with fewer packs than ``world_size x max(1, num_workers)`` is refused up front. With
``repeat=False`` the loader ends with the epoch (ranks may end one micro-batch apart);
training loops use ``repeat=True``.

Sampling (``LoaderConfig.sampling``):

- ``"epoch"`` (default): one global stream of packs (`train.global_order`): epoch ``e`` is a
  permutation of the split's packs that depends only on (seed, e, number of packs), epochs
  follow one another, and each rank takes its slice of every global micro-batch. Every pack is
  read exactly once per epoch across all ranks and workers, whatever the pack count, and the
  loader state is one global position (`DataPosition`): a checkpoint taken on N ranks resumes
  on M ranks with no pack read twice and none skipped in the epoch (elastic resume).
- ``"buffer"``: Energon's streaming default: slices of ``max_samples_per_sequence`` packs read
  in parallel per worker and a shuffle buffer of ``shuffle_buffer_size`` packs, which lets
  epochs overlap (some packs twice before others once). Its state is per rank (Energon's
  ``save_state_rank``), so it resumes only on the number of ranks it was saved with.

Shuffling is seeded by ``LoaderConfig.seed`` (Energon's ``WorkerConfig.seed_offset`` with
``"buffer"``): the same seed and ranks give the same micro-batches. Loader state::

    state = loader_state(loader)                 # bytes, per rank; store beside the model
    loader = make_loader(config, state=state)    # a fresh loader continuing where it stopped
    global_position(loader)                      # "epoch": the DataPosition shared by all ranks
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeAlias

from megatron.energon import SavableDataLoader, WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.errors import reraise_exception

from packvlm.energon import quiet_pin_memory_without_accelerator
from train.dataset import PackedDatasetInfo, TrainConfigError, open_packed_dataset
from train.encoder import PackedBatchTaskEncoder
from train.global_order import DataPosition, GlobalOrderLoader, split_shards
from train.identity import ModelConfigSource
from train.media import DEFAULT_PIXEL_WIRE, PIXEL_WIRES, PixelWire

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
    pixels: PixelWire = DEFAULT_PIXEL_WIRE  # image pixels from the workers: 8-bit, normalised in the step; or float32

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
    if config.sampling == "buffer" and info.num_packs % workers and config.rank == 0:
        log.info(  # a fact about the epoch, not a fault to fix
            "%d packs over %d data-parallel workers (ranks x loader workers): with --sampling buffer %d workers hold "
            "one pack more, so their packs come round a little more often",
            info.num_packs,
            workers,
            info.num_packs % workers,
        )
    return info


Loader: TypeAlias = SavableDataLoader | GlobalOrderLoader


def make_loader(config: LoaderConfig, *, state: bytes | None = None, validate: bool = True) -> Loader:
    """A loader yielding `PackedBatch` (``packs_per_microbatch`` packs each) for this rank.

    Args:
        config: What this rank reads.
        state: `loader_state` of a loader with the same config, to continue where it stopped.
            With ``sampling="epoch"`` any rank's state (or ``DataPosition.to_bytes()``) serves
            any rank of any world size: it is the global position.
        validate: Check the dataset and sizes first (`validate_loader_config`).
    """
    if validate:
        validate_loader_config(config)
    encoder = PackedBatchTaskEncoder(config.processor, config.model, config.pixels)
    if config.sampling == "epoch":
        return _global_order_loader(config, encoder, state)
    dataset = get_train_dataset(
        config.data,
        split_part=config.split,
        worker_config=config.worker_config(),
        batch_size=config.packs_per_microbatch,
        shuffle_buffer_size=config.shuffle_buffer_size,
        max_samples_per_sequence=config.max_samples_per_sequence,
        shuffle_over_epochs_multiplier=1,
        task_encoder=encoder,
        repeat=config.repeat,
    )
    quiet_pin_memory_without_accelerator()
    loader = get_savable_loader(dataset)
    if state is not None:
        loader.restore_state_rank(pickle.loads(state))
    return loader


def _global_order_loader(config: LoaderConfig, encoder: PackedBatchTaskEncoder, state: bytes | None) -> Loader:
    num_packs = sum(shard.count for shard in split_shards(config.data, config.split).shards)
    start = DataPosition(consumed=0, num_packs=num_packs, seed=config.seed)
    if state is not None:
        start = DataPosition.from_bytes(state)
        if (start.num_packs, start.seed) != (num_packs, config.seed):
            raise TrainConfigError(
                f"the saved data position is over {start.num_packs} packs with seed {start.seed}, but {config.data} "
                f"split {config.split!r} holds {num_packs} packs and the seed is {config.seed}: resume with the "
                "data and --seed the run started with"
            )
    return GlobalOrderLoader(
        config.data,
        config.split,
        encoder,
        start=start,
        rank=config.rank,
        world_size=config.world_size,
        packs_per_microbatch=config.packs_per_microbatch,
        num_workers=config.num_workers,
        repeat=config.repeat,
    )


def loader_state(loader: Loader) -> bytes:
    """This rank's loader position as bytes for a checkpoint (the global position with ``"epoch"``)."""
    if isinstance(loader, GlobalOrderLoader):
        return loader.position().to_bytes()
    return pickle.dumps(loader.save_state_rank())


def global_position(loader: Loader) -> DataPosition | None:
    """The position all ranks share (``"epoch"`` sampling), or None for Energon's per-rank state."""
    return loader.position() if isinstance(loader, GlobalOrderLoader) else None


def restore_loader(config: LoaderConfig, state: bytes | None) -> Loader:
    """A fresh loader for ``config`` continuing from ``state`` (None: from the start)."""
    return make_loader(config, state=state)
