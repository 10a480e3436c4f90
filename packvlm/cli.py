"""Click pieces every command group uses: one exit code per kind of failure, ``--debug``, defaults.

`ErrorMappingGroup` ends every command with one exit code per kind of failure (`packvlm.errors`).

Every failure is one line, ``error: <what happened and what to fix>``, and one exit code. The
group catches the four bases, never the stages' classes one by one: `UsageError` (2),
`DataBudgetError` (1), `ResourceError` (3) and `InternalError` (4). click's own usage errors (a
missing or unknown option, a bad value) are printed the same way, exit 2, with the command whose
``--help`` lists the options, instead of click's three-line ``Usage: ... Error: ...`` banner. An
error raised in a DataLoader worker arrives wrapped in torch's "Caught X in DataLoader worker"
text with the worker's traceback: its own message is what is printed (`one_line`).

Errors that are not ours are sorted once here: an ``OSError`` or a
``MemoryError`` is the environment (3; a full disk is named as such: the run resumes once space
is freed), anything else is a bug (4, one line; the traceback only with ``--debug``). Ctrl-C
ends in one line, ``interrupted`` plus the group's `interrupt_hint`, with exit 130 (click
alone prints "Aborted!").

Each default lives once, on the stage's config dataclass; an option shows it with
``default=default_of(Config, "field")``, so ``--help``, the Python API and the manifest agree.
"""

from __future__ import annotations

import dataclasses
import errno
import sys
from typing import Any, ClassVar, NoReturn

import click

from packvlm.errors import ExitCode, PackvlmError
from packvlm.secrets import redact


class ErrorMappingGroup(click.Group):
    """The group must define a ``--debug`` flag (`debug_option`); with it, unexpected errors keep
    their traceback."""

    interrupt_hint: ClassVar[str] = ""  # what Ctrl-C leaves and how to go on, e.g. "rerun ... to resume"

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except PackvlmError as exc:
            if exc.exit_code == ExitCode.INTERNAL and ctx.params.get("debug"):
                raise
            _fail(one_line(str(exc)), exc.exit_code)
        except KeyboardInterrupt:  # one line, exit 130 (128 + SIGINT); click would print "Aborted!"
            hint = f"; {self.interrupt_hint}" if self.interrupt_hint else ""
            newline = "\n" if sys.stderr.isatty() else ""  # past a progress bar's half-drawn line
            click.echo(f"{newline}interrupted{hint}", err=True)
            sys.exit(ExitCode.INTERRUPTED)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (OSError, MemoryError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                _fail(
                    f"no space left on the device ({exc}); free space and rerun the same command: it resumes",
                    ExitCode.RESOURCE,
                )
            if ctx.params.get("debug"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (the machine refused; --debug shows the traceback)", ExitCode.RESOURCE)
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            _fail(
                f"unexpected {type(exc).__name__}: {exc} (a bug in packvlm: please report it with --debug's traceback)",
                ExitCode.INTERNAL,
            )

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """click's entry point; its usage errors become one ``error:`` line (exit 2) like ours."""
        if not kwargs.get("standalone_mode", True):
            return super().main(*args, **kwargs)
        try:
            return super().main(*args, **{**kwargs, "standalone_mode": False})
        except click.exceptions.NoArgsIsHelpError as exc:  # `prep` alone: the help, as click prints it
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            _fail(_click_message(exc), exc.exit_code)
        except click.Abort:  # Ctrl-C while click itself was prompting or parsing
            hint = f"; {self.interrupt_hint}" if self.interrupt_hint else ""
            click.echo(f"interrupted{hint}", err=True)
            sys.exit(ExitCode.INTERRUPTED)


def _click_message(exc: click.ClickException) -> str:
    """click's message on one line, lower-cased first word, with where to look up the options."""
    message = one_line(exc.format_message()).rstrip(".")
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message += f" (`{ctx.command_path} --help` lists the options)"
    return message


_WORKER_WRAP = "in DataLoader worker process"


def one_line(message: str) -> str:
    """A message as one line: a DataLoader worker's wrapped error reduced to its own message."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught ") and _WORKER_WRAP in lines[0]:
        last = lines[-1]  # "module.Class: message", the traceback's last line
        head, sep, rest = last.partition(": ")
        lines = [rest if sep and " " not in head else last]
    return " ".join(lines)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(code)


def debug_option(func: click.decorators.FC) -> click.decorators.FC:
    """``--debug``: keep tracebacks of unexpected errors (read by `ErrorMappingGroup`)."""
    return click.option("--debug", is_flag=True, help="Show tracebacks of unexpected errors.")(func)


def default_of(config_cls: type, name: str) -> Any:
    """The default of field ``name`` of a config dataclass."""
    for f in dataclasses.fields(config_cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{config_cls.__name__}.{name} has no default")
    raise ValueError(f"{config_cls.__name__} has no field {name!r}")
