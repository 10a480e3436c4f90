"""Energon's savable loader over a packed dataset, yielding `PackedBatch` micro-batches.

One call builds what every loop needs: the dataset is validated first (`train.dataset`), then
``get_train_dataset`` with `PackedBatchTaskEncoder` (``batch_size`` = packs per micro-batch)
is wrapped in ``get_savable_loader``. Data-parallel ranks read disjoint packs: Energon splits
the split's packs into ``world_size x max(1, num_workers)`` contiguous ranges, one per global
worker, so a dataset with fewer packs than that is refused up front (some worker would get
none). With ``repeat=False`` ranks may end a few micro-batches apart (ranges differ by one
pack); training loops use ``repeat=True``.

Shuffling (shard slices and the sample buffer) draws from Energon's worker RNG, seeded from
``WorkerConfig.seed_offset`` = ``LoaderConfig.seed`` and the global worker id: the same seed,
ranks and workers give the same micro-batches. Loader state for checkpoints::

    state = loader_state(loader)                 # bytes, per rank; store beside the model
    loader = make_loader(config, state=state)    # a fresh loader continuing where it stopped
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from megatron.energon import SavableDataLoader, WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.errors import reraise_exception

from train.dataset import PackedDatasetInfo, TrainConfigError, open_packed_dataset
from train.encoder import PackedBatchTaskEncoder
from train.identity import ModelConfigSource


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
    shuffle_buffer_size: int | None = 100
    max_samples_per_sequence: int | None = 100
    repeat: bool = True
    split: str = "train"
    context_parallel_size: int = 1  # slots must be multiples of 2x this (checked when the dataset opens)

    def worker_config(self) -> WorkerConfig:
        """Energon's view of this rank; errors re-raised so no pack is ever skipped silently."""
        return WorkerConfig(
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.num_workers,
            seed_offset=self.seed,
            global_error_handler=reraise_exception,
        )


def validate_loader_config(config: LoaderConfig) -> PackedDatasetInfo:
    """Check ranks, sizes and the dataset; `TrainConfigError` names what to change."""
    if config.world_size < 1 or not 0 <= config.rank < config.world_size:
        raise TrainConfigError(f"rank {config.rank} is not in 0..world_size-1 (world_size {config.world_size})")
    if config.num_workers < 0 or config.packs_per_microbatch < 1:
        raise TrainConfigError(
            f"num_workers {config.num_workers} must be >= 0 and packs_per_microbatch {config.packs_per_microbatch} >= 1"
        )
    return open_packed_dataset(
        config.data,
        config.processor,
        model=config.model,
        split=config.split,
        min_packs=config.world_size * max(1, config.num_workers),
        cp_size=config.context_parallel_size,
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
    dataset = get_train_dataset(
        config.data,
        split_part=config.split,
        worker_config=config.worker_config(),
        batch_size=config.packs_per_microbatch,
        shuffle_buffer_size=config.shuffle_buffer_size,
        max_samples_per_sequence=config.max_samples_per_sequence,
        task_encoder=PackedBatchTaskEncoder(config.processor, config.model),
        repeat=config.repeat,
    )
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
