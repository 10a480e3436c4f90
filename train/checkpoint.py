"""Sharded checkpoints that resume exactly, on the same or another number of ranks.

Model and optimizer go through ``torch.distributed.checkpoint`` (DCP): every rank writes the
shards it holds (`get_state_dict` gives FQN-keyed state for a plain module and for an FSDP2
``fully_shard``-ed one alike; replicated tensors are written once), and a load reshards to
whatever the reading ranks hold, so a checkpoint saved on 8 ranks loads on 1 or 16. Beside the
shards: the step and the global data position (`train.global_order.DataPosition`) in
``trainer_state.json``, each rank's RNG, the model's config and the processor's files (so
`train.export` needs nothing but the checkpoint). Layout: :mod:`schemas.train`.

A checkpoint is written under a temp name, renamed when every rank has written, and only then
does ``latest`` move (atomically): a run killed mid-save resumes from the previous complete
checkpoint. ``trainer_state.json`` is written last, so a directory without it is incomplete.
The LR schedule is not saved: it is a function of the step and the options (`train.recipes.hf`).
A disk that fills during the save is `CheckpointDiskFullError` (exit 3): the temp directory
is removed and the previous checkpoint and ``latest`` are as they were.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from packvlm.atomic import write_bytes_atomic
from packvlm.errors import InternalError, ResourceError, UsageError
from schemas.layout import TMP_PREFIX
from schemas.train import (
    CHECKPOINT_GLOB,
    CHECKPOINTS_DIR,
    LATEST_FILE,
    LEGACY_TRAINER_STATE_FILE,
    STATE_DIR,
    TRAIN_LAYOUT_VERSION,
    TRAINER_STATE_FILE,
    checkpoint_name,
    loader_state_name,
    rng_state_name,
)
from train.distributed import DistContext, barrier, gather_objects
from train.global_order import DataPosition

# Files of a processor directory that a checkpoint carries (weights and caches never).
PROCESSOR_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
MODEL_FILES = ("config.json", "generation_config.json")
ADAPTER_CONFIG_FILE = "adapter_config.json"  # a LoRA checkpoint's peft adapter: never a processor file
DISK_FULL_BYTES = 1 << 20  # a write failing with less free than this is a full disk


class CheckpointError(UsageError):
    """No usable checkpoint where --resume or `train export` expects one."""


class CheckpointDiskFullError(ResourceError):
    """The disk filled while a checkpoint was written; the previous one and ``latest`` are untouched."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """What the loop needs besides weights, optimizer and RNG to continue as if never stopped."""

    step: int
    world_size: int  # ranks that wrote the checkpoint
    global_batch_packs: int  # packs per optimizer step over all ranks (ranks x grad_accum x packs/micro-batch)
    data: DataPosition | None  # the global position ("epoch" sampling); None: per-rank loader files ("buffer")
    version: int = TRAIN_LAYOUT_VERSION

    def to_json(self) -> bytes:
        raw = {
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "global_batch_packs": self.global_batch_packs,
            "data": None if self.data is None else self.data.to_dict(),
        }
        return (json.dumps(raw, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: Path) -> TrainerState:
        if raw.get("version") != TRAIN_LAYOUT_VERSION:
            raise CheckpointError(
                f"{where}: checkpoint layout version {raw.get('version')}, this packvlm reads {TRAIN_LAYOUT_VERSION}: "
                "resume with the packvlm that wrote it, or start a new --output"
            )
        data = raw.get("data")
        return cls(
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            global_batch_packs=int(raw["global_batch_packs"]),
            data=None if data is None else DataPosition.from_dict(data),
        )


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
    """Copy a local processor's tokenizer/template/config files (not the model's config nor a checkpoint's state)."""
    if not processor_dir.is_dir():
        return
    for pattern in PROCESSOR_FILE_PATTERNS:
        for src in processor_dir.glob(pattern):
            if src.name not in (*MODEL_FILES, TRAINER_STATE_FILE, ADAPTER_CONFIG_FILE):
                shutil.copy2(src, dest / src.name)


def _no_dist() -> bool:
    """DCP in one process when there is no process group."""
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_checkpoint(
    out: Path,
    ctx: DistContext,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    processor_dir: Path,
    state: TrainerState,
    loader_state: bytes | None,
    keep_last: int = 0,
) -> Path:
    """Write ``OUT/checkpoints/step-N`` collectively; every rank must call it.

    Args:
        out: The run directory.
        ctx: This process.
        model: The trained module (plain or FSDP2-sharded); ``model.config`` is saved beside it.
        optimizer: Its optimizer.
        processor_dir: Processor whose files the checkpoint carries.
        state: Step and global data position (the same on every rank).
        loader_state: This rank's Energon loader state (``"buffer"`` sampling), else None.
        keep_last: Keep only this many newest checkpoints (0: all); older ones go once the new one is complete.
    """
    positions = gather_objects(state.data, ctx)
    if any(p != state.data for p in positions):
        raise InternalError(f"ranks disagree on the data position at step {state.step}: {positions}")
    root = out / CHECKPOINTS_DIR
    final = root / checkpoint_name(state.step)
    # a directory all ranks write into: a fixed temp name (`packvlm.atomic` temp names carry a pid)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(ctx)
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with _quiet_single_process():
            dcp.save(
                {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / STATE_DIR, no_dist=_no_dist()
            )
        torch.save(rng_state(), tmp / rng_state_name(ctx.rank))
        if loader_state is not None:
            torch.save(loader_state, tmp / loader_state_name(ctx.rank))
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if not _disk_full(exc, root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; `latest` still names the previous one
        raise CheckpointDiskFullError(
            f"no space left on the device writing checkpoint {final.name} in {root} ({type(exc).__name__}); the "
            "previous checkpoint and `latest` are intact: free space and rerun the same command with --resume"
        ) from exc
    barrier(ctx)
    if ctx.is_main:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        copy_processor_files(processor_dir, tmp)
        write_bytes_atomic(tmp / TRAINER_STATE_FILE, state.to_json())  # last: the completeness mark
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_bytes_atomic(root / LATEST_FILE, f"{final.name}\n".encode())
        if keep_last:
            _remove_older(root, keep=final, keep_last=keep_last)
    barrier(ctx)
    return final


def _disk_full(exc: BaseException, where: Path) -> bool:
    """ENOSPC / EDQUOT, or a failed write on a filesystem with (almost) nothing left: torch.save
    reports a full disk as a RuntimeError without the errno, and DCP wraps each rank's error."""
    if isinstance(exc, CheckpointException):
        return any(_disk_full(failure, where) for failure, _ in exc.failures.values())
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(where).free < DISK_FULL_BYTES
    except OSError:
        return False


def _remove_older(root: Path, *, keep: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest ``step-N`` checkpoints (never ``keep``, the one ``latest`` names)."""
    steps = sorted(p for p in root.glob(CHECKPOINT_GLOB) if p.is_dir())
    for old in steps[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def check_checkpoint(path: Path) -> Path:
    """``path`` if it is a complete checkpoint of this layout; else `CheckpointError` saying what to do."""
    if (path / LEGACY_TRAINER_STATE_FILE).is_file() and not (path / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(
            f"{path} was written by an older packvlm (checkpoint layout 1: {LEGACY_TRAINER_STATE_FILE}, "
            f"model.safetensors); this packvlm reads layout {TRAIN_LAYOUT_VERSION}: resume it with the packvlm that "
            "wrote it, or start a new --output (its model.safetensors loads in transformers as it is)"
        )
    if not (path / TRAINER_STATE_FILE).is_file() or not (path / STATE_DIR).is_dir():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {TRAINER_STATE_FILE} or {STATE_DIR}/)")
    return path


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    pointer = out / CHECKPOINTS_DIR / LATEST_FILE
    if not pointer.is_file():
        return None
    path = out / CHECKPOINTS_DIR / pointer.read_text(encoding="utf-8").strip()
    try:
        return check_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{pointer} names {path.name}: {exc}") from exc


def load_trainer_state(checkpoint: Path) -> TrainerState:
    path = check_checkpoint(checkpoint) / TRAINER_STATE_FILE
    return TrainerState.from_json(json.loads(path.read_text(encoding="utf-8")), checkpoint)


def load_checkpoint(
    checkpoint: Path, ctx: DistContext, *, model: Any, optimizer: torch.optim.Optimizer
) -> TrainerState:
    """Load weights, optimizer state and this rank's RNG into a freshly built model; return the state.

    Every rank must call it (DCP reads collectively). Weights and optimizer reshard to this
    run's ranks. RNG: each rank takes its own saved stream; a rank the checkpoint had no
    stream for (more ranks than it was saved on) is seeded from (step, rank).
    """
    state = load_trainer_state(checkpoint)
    model_state, optimizer_state = get_state_dict(model, optimizer)  # templates: this run's shards, optimizer state
    # get_state_dict gives every trainable parameter optimizer state (a zero-gradient step); a parameter
    # that had none when saved (no gradient yet, e.g. a vision tower on text-only steps) must get none
    saved = _saved_optimizer_params(checkpoint / STATE_DIR)
    states = cast(dict[str, Any], optimizer_state["state"])
    optimizer_state["state"] = {fqn: v for fqn, v in states.items() if fqn in saved}
    with _quiet_single_process():
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=checkpoint / STATE_DIR,
            no_dist=_no_dist(),
        )
    set_model_state_dict(model, model_state)  # strict: every weight comes from the checkpoint
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=False))
    rng = checkpoint / rng_state_name(ctx.rank)
    if rng.is_file():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    else:
        torch.manual_seed(state.step * 1_000_003 + ctx.rank)
    return state


def _saved_optimizer_params(state_dir: Path) -> set[str]:
    """FQNs of the parameters a DCP checkpoint holds optimizer state for (keys ``optimizer.state.FQN.NAME``)."""
    prefix = "optimizer.state."
    keys = dcp.FileSystemReader(state_dir).read_metadata().state_dict_metadata
    return {key[len(prefix) :].rsplit(".", 1)[0] for key in keys if key.startswith(prefix)}


def load_loader_state(checkpoint: Path, state: TrainerState, ctx: DistContext) -> bytes:
    """What `train.loader.make_loader` continues from: the global position, or this rank's saved state."""
    if state.data is not None:
        return state.data.to_bytes()
    if state.world_size != ctx.world_size:
        raise CheckpointError(
            f"{checkpoint} was saved on {state.world_size} ranks with --sampling buffer, whose loader state is per "
            f"rank; resume on {state.world_size} ranks (--sampling epoch resumes on any number)"
        )
    raw: bytes = torch.load(checkpoint / loader_state_name(ctx.rank), map_location="cpu", weights_only=False)
    return raw


def read_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of a checkpoint, in this process (no process group): for export and tests."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check_checkpoint(checkpoint)
    loaded: dict[str, Any] = {}
    _load_state_dict(  # the loader dcp_to_torch_save uses: every stored key, no template needed
        loaded,
        storage_reader=dcp.FileSystemReader(checkpoint / STATE_DIR),
        planner=_EmptyStateDictLoadPlanner(keys={"model"}),
        no_dist=True,
    )
    return dict(loaded["model"])
