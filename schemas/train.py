"""Layout of a `train` run directory (version 2): metrics, checkpoints, loader state.

Directory (``OUT``)::

    OUT/_run.json                          the run's options (a rerun without --resume is refused)
    OUT/metrics.jsonl                      one StepMetrics line per optimizer step
    OUT/train.log                          the plain-text log of rank 0 (appended on resume)
    OUT/checkpoints/latest                 text: name of the newest complete checkpoint
    OUT/checkpoints/step-00000010/         written as .tmp-step-00000010 then renamed
        config.json, model.safetensors     ``save_pretrained``: loads in plain transformers
        tokenizer*.json, *config.json, chat_template.jinja   the processor's files
        trainer_state.pt                   TrainerState.to_dict(): optimizer, step, RNG (v2: the optimizer
                                           state whole, keyed by parameter name, whatever the sharding)
        loader-rank-00000.pt               Energon ``save_state_rank()`` of each data-parallel rank

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

TRAIN_LAYOUT_VERSION = 2  # 2: optimizer state keyed by parameter name (torch.distributed.checkpoint)
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.pt"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def loader_state_name(rank: int) -> str:
    """File holding one data-parallel rank's loader state inside a checkpoint."""
    return f"loader-rank-{rank:05d}.pt"
