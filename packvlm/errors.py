"""Every way a command can end, one class and one exit code each, so a pipeline wrapper can tell a
bad dataset from a crash without reading the message.

======== =================== ============================================================
exit     class               meaning and what to do
======== =================== ============================================================
0                            done
1        `DataBudgetError`   the data broke a limit: error budget, oversize samples, no
                             sample or no pack at all, media changed since tokenize; fix
                             the data or raise the limit
2        `UsageError`        the command, its options or its input directory are unusable
                             (the message says what to change); nothing was run
3        `ResourceError`     the machine, not the command or the data: disk full, Ray
                             cluster unreachable or lost, no GPU, a missing optional
                             package; fix the environment and rerun the same command
4        `InternalError`     a bug in packvlm (a broken invariant, an unexpected
                             exception): report it with ``--debug``'s traceback
130                          interrupted (Ctrl-C); rerun the same command to resume
======== =================== ============================================================

Stages raise subclasses (keeping a builtin base such as ``ValueError`` where callers catch
one); the CLIs catch the four bases (`packvlm.cli`). Errors found inside a Ray worker
cross back as class + message (`error_payload` / `error_from_payload`) because Ray Data
re-raises a worker's exception as ``UserCodeException`` without its class.

This module imports nothing of ours: every layer, ``schemas`` included, may base its errors here.
"""

from __future__ import annotations

import importlib
import json
import traceback
from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """The exit codes of ``prep`` and ``train``: one meaning each (see the module docstring)."""

    OK = 0
    DATA = 1
    USAGE = 2
    RESOURCE = 3
    INTERNAL = 4
    INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class PackvlmError(Exception):
    """Base of every error a packvlm command ends with; ``exit_code`` says which kind."""

    exit_code: ClassVar[ExitCode] = ExitCode.INTERNAL


class DataBudgetError(PackvlmError):
    """The data broke a limit the user set or accepts (error rate, oversize, nothing to train on)."""

    exit_code = ExitCode.DATA


class UsageError(PackvlmError):
    """The command, an option, or an input directory is unusable; the message names the fix."""

    exit_code = ExitCode.USAGE


class ResourceError(PackvlmError):
    """The environment failed: disk full, cluster unreachable or lost, device or package missing."""

    exit_code = ExitCode.RESOURCE


class InternalError(PackvlmError):
    """A packvlm invariant broke (rows lost, a pack over its size, counts disagreeing): a bug."""

    exit_code = ExitCode.INTERNAL


def error_payload(exc: PackvlmError) -> str:
    """``exc`` as JSON text (class path, message, the worker's traceback) to return from a worker as data."""
    cls = type(exc)
    where = "".join(traceback.format_exception(exc)) if exc.__traceback__ is not None else ""
    return json.dumps({"class": f"{cls.__module__}:{cls.__qualname__}", "message": str(exc), "traceback": where})


def error_from_payload(payload: str) -> PackvlmError:
    """The error `error_payload` wrote, same class and message (its constructor is not called); the
    worker's traceback rides along as a note (printed with ``--debug``'s traceback, not in the message)."""
    raw = json.loads(payload)
    module, _, qualname = raw["class"].partition(":")
    cls: object = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, PackvlmError)):
        raise TypeError(f"{raw['class']} is not a packvlm error")
    exc = cls.__new__(cls)
    exc.args = (raw["message"],)
    if raw.get("traceback"):
        exc.add_note(f"raised in a worker:\n{raw['traceback']}")
    return exc
