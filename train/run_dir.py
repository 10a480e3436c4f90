"""The run directory of both `train` recipes: claimed once, resumed exactly, logged into.

`train hf` and `train megatron` claim ``OUT`` the same way, through `claim_run_dir`, before any
model is built: rank 0 decides and every rank acts on its answer (a refusal on rank 0 alone
would leave the others waiting in a collective). ``OUT/_run.json`` records the recipe and the
options the trajectory depends on (`config_fingerprint`); a directory that holds a run (metrics or
checkpoints) is refused unless ``--resume`` asks to continue it with the same options, and a
resumed run starts from `train.checkpoint.latest_checkpoint`. Layout: `schemas.train`.

    claim_run_dir(OUT, fingerprint=config.fingerprint(), command="train hf", resume=False, ...)
    -> None                          fresh run: OUT/_run.json written, OUT/checkpoints/ created
    claim_run_dir(..., resume=True)  -> OUT/checkpoints/step-00000003   (refused if there is none)
    claim_run_dir(..., resume=True, resume_if_exists=True)  -> the checkpoint, or None: start fresh
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from packvlm.errors import UsageError
from packvlm.output_dir import claim_output_dir
from schemas.layout import RUN_FILE
from schemas.train import CHECKPOINTS_DIR, LOG_FILE, METRICS_FILE
from train.checkpoint import CheckpointError, latest_checkpoint
from train.distributed import DistContext, broadcast_from_main

log = logging.getLogger(__name__)


class TrainRunConflict(UsageError, ValueError):
    """OUT holds another run, or a run that --resume was not asked to continue."""


def config_fingerprint(config: Any, skip: Iterable[str] = ()) -> dict[str, str]:
    """The fields of a recipe's config dataclass that a resumed run must repeat, as strings."""
    skipped = set(skip)
    return {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in skipped}


def claim_run_dir(
    output: Path,
    *,
    fingerprint: dict[str, str],
    command: str,
    resume: bool,
    ctx: DistContext,
    subdirs: tuple[str, ...] = (CHECKPOINTS_DIR,),
    resumable: bool = True,
    resume_if_exists: bool = False,
) -> Path | None:
    """Claim ``output`` for this run on every rank; with ``resume``, the checkpoint to continue from.

    Args:
        output: The run directory (``--output``).
        fingerprint: Options the run depends on (`config_fingerprint`), recorded in ``_run.json``.
        command: The recipe's name, e.g. ``"train hf"``.
        resume: ``--resume`` was given.
        ctx: This process; rank 0 decides for all.
        subdirs: Directories the run writes into (temp files of a killed run are cleared there).
        resumable: The recipe has ``--resume``; the refusal says so only then.
        resume_if_exists: ``--resume-if-exists``: resume when ``output`` holds a checkpoint,
            start fresh when it holds none (a job script that reruns the same command).

    Raises:
        TrainRunConflict: ``output`` holds another run, another command's output, this run
            without ``resume``, or (``resume`` alone) no checkpoint to resume.
    """
    resume = resume or resume_if_exists
    refusal = None
    if ctx.is_main:
        try:
            nothing = resume and not resume_if_exists and latest_checkpoint(output) is None
            if nothing and not (output / RUN_FILE).is_file():  # a new OUT: refused before it is touched
                raise TrainRunConflict(f"nothing to resume in {output}; drop --resume or pass --resume-if-exists")
            _claim_on_main(output, fingerprint, command, resume, subdirs, resumable)  # another run's OUT: named
            if nothing:
                raise TrainRunConflict(f"nothing to resume in {output}; drop --resume or pass --resume-if-exists")
        except (TrainRunConflict, CheckpointError) as exc:  # every rank must raise, not only rank 0
            refusal = str(exc)
    refusal = broadcast_from_main(refusal, ctx)
    if refusal is not None:
        raise TrainRunConflict(refusal)
    checkpoint = latest_checkpoint(output) if resume else None
    if resume and checkpoint is None:
        log.info("--resume-if-exists: no checkpoint in %s yet; starting from step 0", output)
    return checkpoint


def _claim_on_main(
    output: Path, fingerprint: dict[str, str], command: str, resume: bool, subdirs: tuple[str, ...], resumable: bool
) -> None:
    has_run = (output / METRICS_FILE).exists() or (output / CHECKPOINTS_DIR).exists()
    if has_run and not resume:
        fix = "pass --resume to continue it or use a new --output" if resumable else "use a new --output"
        raise TrainRunConflict(f"{output} holds a training run; {fix}")
    output.mkdir(parents=True, exist_ok=True)
    claim_output_dir(output, fingerprint, subdirs, command, TrainRunConflict)


def attach_log_file(path: Path) -> None:
    """Copy this process's log lines into ``OUT/train.log`` (appended, so a resumed run continues it)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    package = logging.getLogger("train")
    if package.getEffectiveLevel() > logging.INFO:  # the step lines are INFO: the file must get them
        package.setLevel(logging.INFO)


def detach_log_file(path: Path) -> None:
    """Close the handler `attach_log_file` added (a later run in this process logs elsewhere)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and handler.baseFilename == str(path.resolve()):
            root.removeHandler(handler)
            handler.close()


@contextlib.contextmanager
def released_on_failure(output: Path, ctx: DistContext, *, created: bool) -> Iterator[None]:
    """Give ``output`` back when the run fails before it wrote a step: no half-claimed folder.

    A run that ends (error, missing package, Ctrl-C) before its first metrics line or checkpoint
    leaves nothing to resume, yet its ``_run.json`` and empty ``checkpoints/`` would make the same
    command refuse the folder as "holds a training run". Removed then: those two, ``train.log``
    and an empty metrics file, and ``output`` itself when this run ``created`` it and it is empty.
    A run that wrote a step keeps everything (``--resume`` continues it).
    """
    try:
        yield
    except BaseException:
        if ctx.is_main:
            _release(output, created)
        raise


def _release(output: Path, created: bool) -> None:
    metrics, checkpoints = output / METRICS_FILE, output / CHECKPOINTS_DIR
    if (metrics.is_file() and metrics.stat().st_size) or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        return
    for name in (RUN_FILE, LOG_FILE, METRICS_FILE):
        (output / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        checkpoints.rmdir()
        if created:
            output.rmdir()  # only when empty: anything else there is not ours
    log.debug("released %s: the run wrote no step", output)
