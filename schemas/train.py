"""Layout of a `train` run directory (version 2): metrics, sharded checkpoints, final export.

Directory (``OUT``)::

    OUT/_run.json                          the run's options (a rerun without --resume is refused)
    OUT/metrics.jsonl                      one StepMetrics line per optimizer step
    OUT/train.log                          the plain-text log of rank 0 (appended on resume)
    OUT/checkpoints/latest                 text: name of the newest complete checkpoint
    OUT/checkpoints/step-00000010/         written as .tmp-step-00000010 then renamed
        state/.metadata, state/__0_0.distcp ...   torch.distributed.checkpoint (DCP): {"model", "optimizer"}
                                           by FQN, each rank's shards; loads on any number of ranks
        trainer_state.json                 TrainerState: version, step, world size, global batch and
                                           the global data position; written last (completeness mark)
        rng-rank-00000.pt                  each rank's RNG state
        loader-rank-00000.pt               Energon ``save_state_rank()`` per rank, --sampling buffer only
        config.json, generation_config.json     the model's config (``train export`` rebuilds from it)
        tokenizer*.json, *config.json, chat_template.jinja   the processor's files
    OUT/final/                             ``train export`` of the last checkpoint when the run reaches
                                           --max-steps: ``save_pretrained`` + processor files

Example ``trainer_state.json`` (3 steps on 2 ranks, 1 pack per micro-batch, grad_accum 2, 40 packs)::

    {"version": 2, "step": 3, "world_size": 2, "global_batch_packs": 4,
     "data": {"consumed": 12, "num_packs": 40, "seed": 0}}

``data.consumed`` counts packs of the global stream (`train.global_order`): epoch
``consumed // num_packs``, of which ``consumed % num_packs`` packs are read. ``data`` is null
with ``--sampling buffer`` (per-rank loader files instead).

Example ``metrics.jsonl`` line (one optimizer step over 2 ranks x 2 micro-batches)::

    {"step": 3, "loss": 6.91, "num_label_tokens": 812, "num_tokens": 16011,
     "num_real_tokens": 16011, "lr": 0.0001, "grad_norm": 1.73, "tokens_per_s": 5120.4,
     "pack_keys": [["pack-00000004", "pack-00000009"], ["pack-00000001", "pack-00000006"]],
     "media": [11, 6], "vision_patches": [9120, 4416]}

``loss`` is the token-weighted mean over the step's label tokens on all ranks (the number the
gradient was normalised by), ``pack_keys``/``media``/``vision_patches`` are per rank, and a
pack key leads back to its samples (``sample_id`` = dataset:line:copy) through the shard's
``json`` member.
"""

from __future__ import annotations

TRAIN_LAYOUT_VERSION = 2  # 1: save_pretrained + trainer_state.pt, same world size only
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.json"
LEGACY_TRAINER_STATE_FILE = "trainer_state.pt"  # layout 1: recognised only to refuse it by name
STATE_DIR = "state"
FINAL_DIR = "final"


CHECKPOINT_GLOB = "step-" + "[0-9]" * 8  # every checkpoint_name; name order is step order


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def loader_state_name(rank: int) -> str:
    """File holding one data-parallel rank's loader state inside a checkpoint."""
    return f"loader-rank-{rank:05d}.pt"


def rng_state_name(rank: int) -> str:
    """File holding one rank's RNG state inside a checkpoint."""
    return f"rng-rank-{rank:05d}.pt"
