"""A click group that turns errors into messages that say what to fix, not tracebacks.

Usage errors (wrong option, unusable input directory) exit 2 with click's usage banner; run
failures (a data budget or an invariant found mid-run) exit 1 with ``error: ...``. Anything
else is a bug or a system error: one line naming it, and the traceback only with ``--debug``.
A full disk is named as such (the run resumes once space is freed). Ctrl-C ends in one line,
``interrupted`` plus the group's `interrupt_hint`, with exit 130 (click alone prints "Aborted!").
"""

from __future__ import annotations

import errno
import sys
from typing import ClassVar, NoReturn

import click


class ErrorMappingGroup(click.Group):
    """Subclasses list the exception types of their commands in the two class attributes.

    The group must define a ``--debug`` flag (`debug_option`); with it, unexpected errors keep
    their traceback.
    """

    usage_errors: ClassVar[tuple[type[Exception], ...]] = ()
    run_failures: ClassVar[tuple[type[Exception], ...]] = ()
    interrupt_hint: ClassVar[str] = ""  # what Ctrl-C leaves and how to go on, e.g. "rerun ... to resume"

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except self.usage_errors as exc:
            raise click.UsageError(str(exc)) from exc
        except self.run_failures as exc:
            _fail(str(exc))
        except KeyboardInterrupt:  # one line, exit 130 (128 + SIGINT); click would print "Aborted!"
            hint = f"; {self.interrupt_hint}" if self.interrupt_hint else ""
            newline = "\n" if sys.stderr.isatty() else ""  # past a progress bar's half-drawn line
            click.echo(f"{newline}interrupted{hint}", err=True)
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                _fail(f"no space left on the device ({exc}); free space and rerun the same command: it resumes")
            if ctx.params.get("debug"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            _fail(f"unexpected {type(exc).__name__}: {exc} (a bug or a system error; --debug shows the traceback)")


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def debug_option(func: click.decorators.FC) -> click.decorators.FC:
    """``--debug``: keep tracebacks of unexpected errors (read by `ErrorMappingGroup`)."""
    return click.option("--debug", is_flag=True, help="Show tracebacks of unexpected errors.")(func)
