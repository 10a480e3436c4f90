"""Click pieces shared by the stage commands: defaults read from the config dataclasses.

Each default lives once, on the stage's config dataclass; an option shows it with
``default=default_of(Config, "field")``, so `--help`, the Python API and the manifest agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import click

from prep.run import EXECUTORS, ExecutorConfig

F = TypeVar("F", bound=Callable[..., Any])


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
