"""Executors: run the same per-task worker in-process or on Ray Data.

A worker is a class built once per process from plain, JSON-safe kwargs (paths, numbers)
and called on a batch ``{"task": [json, ...]}``, returning a batch of small stat rows. The
local executor is a for-loop with a progress bar; the Ray executor maps the tasks over an
actor pool so processors and LMDB handles are opened once per actor. The pool leaves one
CPU free (Ray Data needs it for its own tasks; ray#44687). Connects to a cluster when
``address`` or ``RAY_ADDRESS`` is set, otherwise starts an embedded Ray.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tqdm import tqdm

from prep.worker_errors import unwrap_worker_error

log = logging.getLogger(__name__)
Worker = Callable[[dict[str, list]], dict[str, list]]
ExecutorName = Literal["ray", "local"]
EXECUTORS: tuple[ExecutorName, ...] = ("ray", "local")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorConfig:
    """Where a stage's tasks run; never changes the output."""

    executor: ExecutorName = "ray"
    ray_address: str | None = None
    num_workers: int | None = None


def run_tasks(
    worker_cls: type, worker_kwargs: dict[str, Any], tasks: list[str], config: ExecutorConfig, desc: str
) -> list[dict]:
    """Run tasks on the configured executor; our worker input errors surface with their own message."""
    if not tasks:
        return []
    if config.executor == "local":
        return run_local(worker_cls, worker_kwargs, tasks, desc=desc)
    try:
        return run_ray(worker_cls, worker_kwargs, tasks, address=config.ray_address, num_workers=config.num_workers)
    except KeyboardInterrupt:  # stop the embedded Ray's workers now, not when they notice the driver is gone
        _shutdown_embedded_ray(config)
        raise
    except Exception as exc:  # Ray wraps worker errors: surface ours with their own message
        ours = unwrap_worker_error(exc)
        if ours is None or ours is exc:
            raise
        raise ours from exc


def _shutdown_embedded_ray(config: ExecutorConfig) -> None:
    """Shut down a Ray this process started (never a cluster it joined)."""
    import ray

    if ray.is_initialized() and not (config.ray_address or os.environ.get("RAY_ADDRESS")):
        ray.shutdown()


def run_local(worker_cls: type, worker_kwargs: dict[str, Any], tasks: list[str], desc: str) -> list[dict]:
    """Run tasks one by one in this process."""
    worker = worker_cls(**worker_kwargs)
    rows: list[dict] = []
    for task in tqdm(tasks, desc=desc, unit="task", disable=not sys.stderr.isatty()):
        out = worker({"task": [task]})
        rows.extend(dict(zip(out, values)) for values in zip(*out.values()))
    return rows


def init_ray(address: str | None, num_cpus: int | None) -> None:
    """Join a cluster (address / RAY_ADDRESS) or start an embedded Ray; reuse a live session."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def run_ray(
    worker_cls: type,
    worker_kwargs: dict[str, Any],
    tasks: list[str],
    *,
    address: str | None = None,
    num_workers: int | None = None,
) -> list[dict]:
    """Map tasks over a Ray Data actor pool; each actor builds ``worker_cls`` once."""
    import ray

    init_ray(address, None)
    cpus = int(ray.available_resources().get("CPU", 1))
    size = num_workers or max(1, cpus - 1)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ds = ray.data.from_items([{"task": t} for t in tasks], override_num_blocks=max(1, len(tasks)))
    mapped = ds.map_batches(
        worker_cls,
        fn_constructor_kwargs=worker_kwargs,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=1,
    )
    return mapped.take_all()


LOCAL = ExecutorConfig(executor="local")  # in-process, for tests and small runs
