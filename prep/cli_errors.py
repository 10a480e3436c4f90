"""A click group that turns known errors into messages that say what to fix, not tracebacks.

Usage errors (wrong option, unusable input directory) exit 2 with click's usage banner; run
failures (a broken invariant found mid-run) exit 1 with ``error: ...``. Anything else is a
bug or a system error and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import ClassVar

import click


class ErrorMappingGroup(click.Group):
    """Subclasses list the exception types of their commands in the two class attributes."""

    usage_errors: ClassVar[tuple[type[Exception], ...]] = ()
    run_failures: ClassVar[tuple[type[Exception], ...]] = ()

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except self.usage_errors as exc:
            raise click.UsageError(str(exc)) from exc
        except self.run_failures as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
