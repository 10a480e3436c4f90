"""A click group that ends every command with one exit code per kind of failure (`packvlm.errors`).

The group catches the four bases, never the stages' classes one by one: `UsageError` exits 2
with click's usage banner; `DataBudgetError` (1), `ResourceError` (3) and `InternalError` (4)
print ``error: ...``. Errors that are not ours are sorted once here: an ``OSError`` or a
``MemoryError`` is the environment (3; a full disk is named as such: the run resumes once space
is freed), anything else is a bug (4, one line; the traceback only with ``--debug``). Ctrl-C
ends in one line, ``interrupted`` plus the group's `interrupt_hint`, with exit 130 (click
alone prints "Aborted!").
"""

from __future__ import annotations

import errno
import sys
from typing import ClassVar, NoReturn

import click

from packvlm.errors import ExitCode, PackvlmError, UsageError
from packvlm.secrets import redact


class ErrorMappingGroup(click.Group):
    """The group must define a ``--debug`` flag (`debug_option`); with it, unexpected errors keep
    their traceback."""

    interrupt_hint: ClassVar[str] = ""  # what Ctrl-C leaves and how to go on, e.g. "rerun ... to resume"

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise click.UsageError(redact(str(exc))) from exc
        except PackvlmError as exc:
            if exc.exit_code == ExitCode.INTERNAL and ctx.params.get("debug"):
                raise
            _fail(str(exc), exc.exit_code)
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


def _fail(message: str, code: ExitCode) -> NoReturn:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(code)


def debug_option(func: click.decorators.FC) -> click.decorators.FC:
    """``--debug``: keep tracebacks of unexpected errors (read by `ErrorMappingGroup`)."""
    return click.option("--debug", is_flag=True, help="Show tracebacks of unexpected errors.")(func)
