"""Send a run's numbers to the dashboards a team watches: TensorBoard and Weights & Biases.

``metrics.jsonl`` stays the run's trace (`train.metrics`); `train hf --report-to tensorboard
--report-to wandb` also sends, from rank 0 once per optimizer step, the scalars below. Both
packages are optional and imported only when asked for; a missing one is an environment error
naming the install.

    train/loss, train/lr, train/grad_norm, train/tokens_per_s,      every step (from StepMetrics)
    train/num_label_tokens, train/real_token_fraction
    memory/peak_gib                                                  every step: CUDA peak allocated
                                                                     since the last step, or the
                                                                     process's peak RSS on CPU
    eval/loss, eval/num_label_tokens                                 when `train.evaluate` ran

TensorBoard writes event files under ``OUT/tensorboard``. wandb writes under ``OUT/wandb``; with
``WANDB_MODE=offline`` it needs no network or account (``wandb sync OUT/wandb/offline-run-*``
uploads later). The wandb run id is kept in ``OUT/wandb-run-id`` so ``--resume`` continues the
same run; project from ``WANDB_PROJECT`` (default "packvlm"), name = the run directory's name.
"""

from __future__ import annotations

import os
import resource
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from packvlm.errors import ResourceError
from train.evaluate import EvalResult
from train.metrics import StepMetrics

REPORTERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"
WANDB_DEFAULT_PROJECT = "packvlm"


class ReporterUnavailableError(ResourceError):
    """``--report-to`` names a package that is not installed."""


class Reporter(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


def step_scalars(metrics: StepMetrics, device: torch.device) -> dict[str, float]:
    """The per-step scalars of one optimizer step, with this process's peak memory."""
    return {
        "train/loss": metrics.loss,
        "train/lr": metrics.lr,
        "train/grad_norm": metrics.grad_norm,
        "train/tokens_per_s": metrics.tokens_per_s,
        "train/num_label_tokens": float(metrics.num_label_tokens),
        "train/real_token_fraction": metrics.real_token_fraction,
        "memory/peak_gib": peak_memory_gib(device),
    }


def eval_scalars(result: EvalResult) -> dict[str, float]:
    return {"eval/loss": result.loss, "eval/num_label_tokens": float(result.num_label_tokens)}


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: peak allocated since the previous call (the counter is reset); CPU: peak RSS of the process."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


class TensorBoardReporter:
    def __init__(self, output: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ReporterUnavailableError(
                f"--report-to tensorboard needs the tensorboard package ({exc}): pip install tensorboard"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(output / TENSORBOARD_DIR))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    def __init__(self, output: Path, config: Mapping[str, Any], *, resumed: bool) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ReporterUnavailableError(
                f"--report-to wandb needs the wandb package ({exc}): pip install wandb"
            ) from exc
        id_file = output / WANDB_ID_FILE
        resume = resumed and id_file.is_file()
        run_id = id_file.read_text(encoding="utf-8").strip() if resume else uuid.uuid4().hex[:8]
        id_file.write_text(run_id, encoding="utf-8")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_DEFAULT_PROJECT),
            name=output.name,
            id=run_id,
            resume="allow",
            dir=str(output),
            config=dict(config),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class Reporters:
    """All requested reporters as one (none on ranks other than 0)."""

    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    @property
    def active(self) -> bool:
        """Whether anything is reported (scalars, and the CUDA peak-memory reset, only then)."""
        return bool(self.reporters)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for reporter in self.reporters:
            reporter.log(step, scalars)

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()


def open_reporters(
    names: tuple[str, ...], output: Path, config: Mapping[str, Any], is_main: bool, *, resumed: bool
) -> Reporters:
    """The reporters ``names`` asks for, writing under ``output`` (rank 0 only)."""
    if not is_main:
        return Reporters([])
    reporters: list[Reporter] = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            reporters.append(TensorBoardReporter(output))
        elif name == "wandb":
            reporters.append(WandbReporter(output, config, resumed=resumed))
        else:
            raise ValueError(f"unknown reporter {name!r}; use one of {', '.join(REPORTERS)}")
    return Reporters(reporters)
