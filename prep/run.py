"""Executors: run the same per-task worker in-process or on Ray Data.

A worker is a class built once per process from plain, JSON-safe kwargs (paths, numbers)
and called on a batch ``{"task": [json, ...]}``, returning a batch of small stat rows. The
local executor is a for-loop with a progress bar; the Ray executor maps the tasks over an
actor pool so processors and LMDB handles are opened once per actor. The pool leaves one
CPU free (Ray Data needs it for its own tasks; ray#44687). Connects to a cluster when
``address`` or ``RAY_ADDRESS`` is set, otherwise starts a private local Ray
(``address="local"``: never the cluster a stale ``/tmp/ray/ray_current_cluster`` names).

Errors cross Ray as data: Ray Data re-raises a worker's exception as ``UserCodeException``
without its class, so `ErrorCarrier` returns whatever a worker raised as one row (ours as
they are, the machine's refusals as `WorkerResourceError`, anything else as `WorkerBug`), and
the driver raises that class with its message (`packvlm.errors.error_payload`). Ray's own
failures (an actor or node lost, a cluster that cannot be reached or started) are
`RayUnavailableError`, an environment error.

``auto`` (the default) picks per run, and says which and why at start (`resolve_executor`):
a cluster address (``--ray-address`` / ``RAY_ADDRESS``) -> Ray; no cluster and fewer than
``AUTO_RAY_MIN_CPUS`` usable CPUs, or a single task -> local. Measured on 2 cores
(`benchmarks/bench_tokenize.py`): an embedded Ray gets one actor there (one CPU stays free
for Ray Data), which tokenizes at 0.85x the local executor's rows/s with ~4x its memory
plus its start-up; from 4 CPUs its 3 actors outrun one local process.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

from tqdm import tqdm

from packvlm.errors import InternalError, PackvlmError, ResourceError, error_from_payload, error_payload
from prep.ray_reaper import children, start_reaper
from prep.ray_reaper import supported as reaper_supported

log = logging.getLogger(__name__)
Worker = Callable[[dict[str, list]], dict[str, list]]
ExecutorName = Literal["auto", "ray", "local"]
EXECUTORS: tuple[ExecutorName, ...] = ("auto", "ray", "local")
AUTO_RAY_MIN_CPUS = 4  # below: Ray's pool of CPUs - 1 actors cannot beat one local process
# An embedded Ray prestarts one idle Python worker per CPU (~50 MB PSS each, and CPU while
# Ray starts); the actor pool starts the workers it needs itself. Ray's RayConfig names.
EMBEDDED_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
_REAPERS: list[subprocess.Popen[bytes]] = []  # kept open: each reads EOF when this process exits
ERROR_COLUMN = "__packvlm_error__"  # a worker's row carrying one of our errors (`error_payload`)
_QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)  # Ray's token-auth notices


class RayUnavailableError(ResourceError):
    """Ray could not be started or reached, or lost an actor or node mid-run: rerun to resume."""


class WorkerResourceError(ResourceError):
    """The machine refused a worker (an ``OSError`` such as a full disk, or ``MemoryError``)."""


class WorkerBug(InternalError):
    """An unexpected exception in a worker (not one of ours): its type and message, the traceback with --debug."""


class ErrorCarrier:
    """Wraps a worker for Ray: our errors (from its constructor too) come back as an `ERROR_COLUMN` row;
    any other exception comes back as a `WorkerBug` (one line, not Ray's wrapped traceback).

    Args:
        worker_cls: The stage's worker class (importable: actors import it by name).
        worker_kwargs: Its JSON-safe constructor kwargs.
    """

    def __init__(self, worker_cls: type, worker_kwargs: dict[str, Any]) -> None:
        self.worker: Worker | None = None
        self.error: PackvlmError | None = None
        try:
            self.worker = worker_cls(**worker_kwargs)
        except Exception as exc:
            self.error = _ours(exc)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        try:
            if self.worker is None:
                raise self.error or RuntimeError("worker not built")
            return self.worker(batch)
        except Exception as exc:
            return {ERROR_COLUMN: [error_payload(_ours(exc))]}


def _ours(exc: Exception) -> PackvlmError:
    """``exc`` if it is ours; the environment's refusals as `WorkerResourceError`, the rest as
    `WorkerBug`, sorted as the CLI sorts them in the driver (`packvlm.cli`)."""
    if isinstance(exc, PackvlmError):
        return exc
    ours: PackvlmError
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        ours = WorkerResourceError(f"no space left on the device ({exc}); free space and rerun the same command")
    elif isinstance(exc, (OSError, MemoryError)):
        ours = WorkerResourceError(f"{type(exc).__name__} in a worker: {exc}")
    else:
        ours = WorkerBug(f"{type(exc).__name__} in a worker: {exc}")
    ours.__traceback__ = exc.__traceback__
    return ours


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
    if importlib.util.find_spec("ray") is None:  # ray is a dependency, but an image may lack it
        return ExecutorChoice(name="local", reason=f"auto: no cluster address, {cpus} CPUs, Ray not installed")
    return ExecutorChoice(name="ray", reason=f"auto: no cluster address, {cpus} CPUs: embedded Ray")


def run_tasks(
    worker_cls: type, worker_kwargs: dict[str, Any], tasks: list[str], config: ExecutorConfig, desc: str
) -> list[dict]:
    """Run tasks on the configured executor; our errors from workers surface as the same class."""
    if not tasks:
        return []
    choice = resolve_executor(config, len(tasks))
    log.info("%s: %d tasks on the %s executor (%s)", desc, len(tasks), choice.name, choice.reason)
    if choice.name == "local":
        return run_local(worker_cls, worker_kwargs, tasks, desc=desc)
    with _interruptible(config):
        return run_ray(
            worker_cls, worker_kwargs, tasks, address=config.ray_address, num_workers=config.num_workers, desc=desc
        )


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
    """Join a cluster (address / RAY_ADDRESS) or start a private local Ray; reuse a live session.

    Without an address Ray is started with ``address="local"``: a plain ``ray.init()`` would
    follow Ray's bootstrap file (``/tmp/ray/ray_current_cluster``), which any crashed ``ray
    start`` on the machine leaves behind, and retry its dead address for minutes. An embedded
    Ray gets a reaper (`prep.ray_reaper`): its processes die with this one, even on kill -9,
    instead of lingering ~60 s.

    Raises:
        RayUnavailableError: The cluster cannot be reached, or the local Ray did not start.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _ray_init(f"cannot join the Ray cluster at {address!r}", address=address, log_to_driver=True)
        return
    before = children(os.getpid()) if reaper_supported() else {}
    _ray_init(
        "cannot start a local Ray",
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        _system_config=EMBEDDED_RAY_CONFIG,
    )
    now = children(os.getpid()) if reaper_supported() else {}
    started = {pid: start for pid, start in now.items() if pid not in before}
    if started:
        _REAPERS.append(start_reaper(started))


def _ray_init(failure: str, **kwargs: Any) -> None:
    """``ray.init(**kwargs)`` with its token-auth notices muted; its failures become `RayUnavailableError`."""
    import ray

    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        ray.init(**kwargs)
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        raise RayUnavailableError(f"{failure}: {exc}") from exc
    except Exception as exc:  # startup timeouts are raised as a plain Exception
        if type(exc) is not Exception:
            raise
        raise RayUnavailableError(f"{failure}: {exc}") from exc
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


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
    Data's bar reports "finished" when the run is interrupted, so it is turned off. Actors are
    not restarted (``max_restarts=0``): a lost actor ends the run as `RayUnavailableError` and
    the rerun resumes, instead of Ray retrying forever (and logging an error line at start
    about restartable actors whose constructor arguments sit in the object store).
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
    with warnings.catch_warnings():  # max_restarts has no named parameter yet (Ray 2.60 deprecates the rest)
        warnings.simplefilter("ignore", DeprecationWarning)
        mapped = ds.map_batches(
            ErrorCarrier,
            fn_constructor_kwargs={"worker_cls": worker_cls, "worker_kwargs": worker_kwargs},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=size),
            num_cpus=1,
            max_restarts=0,
        )
    rows: list[dict] = []
    with tqdm(total=len(tasks), desc=desc, unit="task", disable=not sys.stderr.isatty()) as bar:
        try:
            for row in mapped.iter_rows():
                if row.get(ERROR_COLUMN):
                    raise error_from_payload(row[ERROR_COLUMN])
                rows.append(dict(row))
                bar.update(1)
        except ray.exceptions.RayTaskError:
            raise  # Ray Data's own code failed in a task: a bug, reported as such
        except ray.exceptions.RayError as exc:  # actor, node or object lost; cluster gone
            raise RayUnavailableError(f"Ray failed mid-run ({type(exc).__name__}: {exc}); rerun to resume") from exc
    return rows


def _drop_bars_disabled_notice(record: logging.LogRecord) -> bool:
    """Ray Data's "Progress bars disabled. To enable, ..." warning: ours is on instead."""
    return not record.getMessage().startswith("Progress bars disabled")


LOCAL = ExecutorConfig(executor="local")  # in-process, for tests and small runs
