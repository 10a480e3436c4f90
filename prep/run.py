"""Executors: run the same per-task worker in-process or on Ray Data.

A worker is a class built once per process from plain, JSON-safe kwargs (paths, numbers)
and called on a batch ``{"task": [json, ...]}``, returning a batch of small stat rows. The
local executor is a for-loop with a progress bar; the Ray executor maps the tasks over an
actor pool so processors and LMDB handles are opened once per actor. The pool leaves one
CPU free (Ray Data needs it for its own tasks; ray#44687). Connects to a cluster when
``address`` or ``RAY_ADDRESS`` is set, otherwise starts an embedded Ray.

``auto`` (the default) picks per run, and says which and why at start (`resolve_executor`):
a cluster address (``--ray-address`` / ``RAY_ADDRESS``) -> Ray; no cluster and fewer than
``AUTO_RAY_MIN_CPUS`` usable CPUs, or a single task -> local. Measured on 2 cores
(`benchmarks/bench_tokenize.py`): an embedded Ray gets one actor there (one CPU stays free
for Ray Data), which tokenizes at 0.85x the local executor's rows/s with ~4x its memory
plus its start-up; from 4 CPUs its 3 actors outrun one local process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

from tqdm import tqdm

from prep.ray_reaper import children, start_reaper
from prep.ray_reaper import supported as reaper_supported
from prep.worker_errors import unwrap_worker_error

log = logging.getLogger(__name__)
Worker = Callable[[dict[str, list]], dict[str, list]]
ExecutorName = Literal["auto", "ray", "local"]
EXECUTORS: tuple[ExecutorName, ...] = ("auto", "ray", "local")
AUTO_RAY_MIN_CPUS = 4  # below: Ray's pool of CPUs - 1 actors cannot beat one local process
# An embedded Ray prestarts one idle Python worker per CPU (~50 MB PSS each, and CPU while
# Ray starts); the actor pool starts the workers it needs itself. Ray's RayConfig names.
EMBEDDED_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
_REAPERS: list[subprocess.Popen[bytes]] = []  # kept open: each reads EOF when this process exits


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorConfig:
    """Where a stage's tasks run; never changes the output."""

    executor: ExecutorName = "auto"
    ray_address: str | None = None
    num_workers: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorChoice:
    """The executor a run uses and why (printed at start)."""

    name: Literal["ray", "local"]
    reason: str


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask: containers and taskset shrink it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_executor(config: ExecutorConfig, num_tasks: int) -> ExecutorChoice:
    """``auto`` -> Ray on a given cluster or on a machine with cores to spare, else local."""
    if config.executor != "auto":
        return ExecutorChoice(name=config.executor, reason="--executor")
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        return ExecutorChoice(name="ray", reason=f"auto: cluster address {address}")
    cpus = usable_cpus()
    if num_tasks < 2:
        return ExecutorChoice(name="local", reason=f"auto: no cluster address, {num_tasks} task")
    if cpus < AUTO_RAY_MIN_CPUS:
        return ExecutorChoice(name="local", reason=f"auto: no cluster address, {cpus} CPUs < {AUTO_RAY_MIN_CPUS}")
    return ExecutorChoice(name="ray", reason=f"auto: no cluster address, {cpus} CPUs: embedded Ray")


def run_tasks(
    worker_cls: type, worker_kwargs: dict[str, Any], tasks: list[str], config: ExecutorConfig, desc: str
) -> list[dict]:
    """Run tasks on the configured executor; our worker input errors surface with their own message."""
    if not tasks:
        return []
    choice = resolve_executor(config, len(tasks))
    log.info("%s: %d tasks on the %s executor (%s)", desc, len(tasks), choice.name, choice.reason)
    if choice.name == "local":
        return run_local(worker_cls, worker_kwargs, tasks, desc=desc)
    try:
        with _interruptible(config):
            return run_ray(
                worker_cls, worker_kwargs, tasks, address=config.ray_address, num_workers=config.num_workers, desc=desc
            )
    except Exception as exc:  # Ray wraps worker errors: surface ours with their own message
        ours = unwrap_worker_error(exc)
        if ours is None or ours is exc:
            raise
        raise ours from exc


@contextlib.contextmanager
def _interruptible(config: ExecutorConfig) -> Iterator[None]:
    """Ctrl-C during a Ray run: nothing more from Ray on the console, the embedded Ray shut
    down at once, then KeyboardInterrupt goes on to the CLI, which prints one line.

    Without this, Ray Data's executor logs ``Dataset ... execution finished in N seconds``
    (and closes its bar as finished) from the ``finally`` of its own iterator
    (``ray.data._internal.execution.streaming_executor.StreamingExecutor.shutdown``), before
    any ``except`` of ours runs, and the driver prints the raylet's retry notices for the
    actors the shutdown kills (``ray._private.worker.print_to_stdstream``, which writes to
    ``sys.stdout``/``sys.stderr`` as they are when it prints). So our SIGINT handler mutes
    both first, then raises KeyboardInterrupt.
    """
    data_logger = logging.getLogger("ray.data")
    level, streams = data_logger.level, (sys.stdout, sys.stderr)
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if on_main else None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        data_logger.setLevel(logging.CRITICAL)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # closed in the finally below
        raise KeyboardInterrupt

    if on_main:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    except KeyboardInterrupt:  # stop the embedded Ray's workers now, not when they notice the driver is gone
        _shutdown_embedded_ray(config)
        raise
    finally:
        if on_main:
            signal.signal(signal.SIGINT, previous)
        if sys.stderr is not streams[1]:
            sys.stderr.close()
        sys.stdout, sys.stderr = streams
        data_logger.setLevel(level)


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
    """Join a cluster (address / RAY_ADDRESS) or start an embedded Ray; reuse a live session.

    An embedded Ray gets a reaper (`prep.ray_reaper`): its processes die with this one,
    even on kill -9, instead of lingering ~60 s.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    before = children(os.getpid()) if reaper_supported() else {}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, _system_config=EMBEDDED_RAY_CONFIG)
    now = children(os.getpid()) if reaper_supported() else {}
    started = {pid: start for pid, start in now.items() if pid not in before}
    if started:
        _REAPERS.append(start_reaper(started))


def run_ray(
    worker_cls: type,
    worker_kwargs: dict[str, Any],
    tasks: list[str],
    *,
    address: str | None = None,
    num_workers: int | None = None,
    desc: str = "tasks",
) -> list[dict]:
    """Map tasks over a Ray Data actor pool; each actor builds ``worker_cls`` once.

    Progress is our own bar over the result rows (one per task, as in `run_local`): Ray
    Data's bar reports "finished" when the run is interrupted, so it is turned off.
    """
    import ray

    init_ray(address, None)
    cpus = int(ray.available_resources().get("CPU", 1))
    size = num_workers or max(1, cpus - 1)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data._internal.progress").addFilter(_drop_bars_disabled_notice)
    ds = ray.data.from_items([{"task": t} for t in tasks], override_num_blocks=max(1, len(tasks)))
    mapped = ds.map_batches(
        worker_cls,
        fn_constructor_kwargs=worker_kwargs,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=1,
    )
    rows: list[dict] = []
    with tqdm(total=len(tasks), desc=desc, unit="task", disable=not sys.stderr.isatty()) as bar:
        for row in mapped.iter_rows():
            rows.append(dict(row))
            bar.update(1)
    return rows


def _drop_bars_disabled_notice(record: logging.LogRecord) -> bool:
    """Ray Data's "Progress bars disabled. To enable, ..." warning: ours is on instead."""
    return not record.getMessage().startswith("Progress bars disabled")


LOCAL = ExecutorConfig(executor="local")  # in-process, for tests and small runs
