"""Checkpoints that resume exactly: model, optimizer, RNG, step and loader state.

The model and the processor's files go through ``save_pretrained``/file copies so a
checkpoint loads in plain transformers; everything the loop needs to continue sits beside
them (:mod:`schemas.train` gives the layout). A checkpoint is written under a temp name and
renamed only when every rank has written its loader state, then ``latest`` is replaced
atomically: a run killed mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packvlm.atomic import write_bytes_atomic
from packvlm.errors import UsageError
from schemas.layout import TMP_PREFIX
from schemas.train import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    TRAIN_LAYOUT_VERSION,
    TRAINER_STATE_FILE,
    checkpoint_name,
    loader_state_name,
)
from train.distributed import DistContext, barrier

# Files of a processor directory that a checkpoint carries (weights and caches never).
PROCESSOR_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
MODEL_FILES = ("config.json", "generation_config.json")


class CheckpointError(UsageError):
    """No usable checkpoint where --resume expects one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """What the loop needs besides the weights to continue as if never stopped."""

    step: int
    optimizer: dict[str, Any]
    rng: dict[str, Any]  # the LR schedule is not saved: it is rebuilt from the step and options
    version: int = TRAIN_LAYOUT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "optimizer": self.optimizer,
            "rng": self.rng,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainerState:
        if raw.get("version") != TRAIN_LAYOUT_VERSION:
            raise CheckpointError(
                f"trainer state version {raw.get('version')}; this packvlm reads {TRAIN_LAYOUT_VERSION}"
            )
        return cls(step=raw["step"], optimizer=raw["optimizer"], rng=raw["rng"])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def copy_processor_files(processor_dir: Path, dest: Path) -> None:
    """Copy a local processor's tokenizer/template/config files (not the model's config)."""
    if not processor_dir.is_dir():
        return
    for pattern in PROCESSOR_FILE_PATTERNS:
        for src in processor_dir.glob(pattern):
            if src.name not in MODEL_FILES:
                shutil.copy2(src, dest / src.name)


def save_checkpoint(
    out: Path,
    ctx: DistContext,
    *,
    model: Any,
    model_state: dict[str, Any] | None = None,
    processor_dir: Path,
    state: TrainerState,
    loader_state: Any,
) -> Path:
    """Write ``OUT/checkpoints/step-N`` collectively; every rank must call it.

    ``model_state``: the whole state dict on rank 0 when the model is sharded
    (`train.sharding.full_model_state`); by default the model's own.
    """
    root = out / CHECKPOINTS_DIR
    final = root / checkpoint_name(state.step)
    # a directory all ranks write into: a fixed temp name (`packvlm.atomic` temp names carry a pid)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(ctx)
    torch.save(loader_state, tmp / loader_state_name(ctx.rank))
    if ctx.is_main:
        model.save_pretrained(tmp, state_dict=model_state)
        copy_processor_files(processor_dir, tmp)
        torch.save(state.to_dict(), tmp / TRAINER_STATE_FILE)
    barrier(ctx)
    if ctx.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_bytes_atomic(root / LATEST_FILE, f"{final.name}\n".encode())
    barrier(ctx)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    pointer = out / CHECKPOINTS_DIR / LATEST_FILE
    if not pointer.is_file():
        return None
    path = out / CHECKPOINTS_DIR / pointer.read_text(encoding="utf-8").strip()
    if not (path / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete; remove it or the pointer")
    return path


def load_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState.from_dict(torch.load(checkpoint / TRAINER_STATE_FILE, map_location="cpu", weights_only=False))


def load_loader_state(checkpoint: Path, ctx: DistContext) -> Any:
    """This rank's saved loader state; a different world size cannot resume exactly."""
    path = checkpoint / loader_state_name(ctx.rank)
    if not path.is_file() or (checkpoint / loader_state_name(ctx.world_size)).is_file():
        raise CheckpointError(
            f"{checkpoint} holds loader states of another number of ranks than {ctx.world_size}; "
            "resume with the world size it was saved with"
        )
    return torch.load(path, map_location="cpu", weights_only=False)
