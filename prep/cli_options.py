"""Click options the prep stage commands share: where their tasks run (`prep.run`).

Defaults come from the config dataclasses (`packvlm.cli.default_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from packvlm.cli import default_of
from prep.run import EXECUTORS, ExecutorConfig

F = TypeVar("F", bound=Callable[..., Any])


def executor_options(func: F) -> F:
    """``--executor``, ``--ray-address``, ``--num-workers``; the command gets ``executor: ExecutorConfig``."""

    def build(ctx: click.Context, _param: click.Parameter, value: str) -> ExecutorConfig:
        return ExecutorConfig(
            executor=value,  # type: ignore[arg-type]  # click.Choice restricts it
            ray_address=ctx.params.pop("ray_address", None),
            num_workers=ctx.params.pop("num_workers", None),
        )

    func = click.option(
        "--executor",
        type=click.Choice(EXECUTORS),
        default=default_of(ExecutorConfig, "executor"),
        show_default=True,
        callback=build,
        help="auto: Ray when a cluster address is given or the machine has >= 4 CPUs and there are >= 2 tasks, "
        "else local (the choice is printed); ray: tasks on a Ray actor pool (a cluster via "
        "--ray-address/RAY_ADDRESS, else an embedded Ray); local: in this process.",
    )(func)
    func = click.option(
        "--num-workers", type=click.IntRange(min=1), default=None, is_eager=True, help="Ray actors (default: CPUs - 1)."
    )(func)
    return click.option(
        "--ray-address",
        default=default_of(ExecutorConfig, "ray_address"),
        is_eager=True,
        help="Ray cluster address (default: RAY_ADDRESS or embedded Ray).",
    )(func)
