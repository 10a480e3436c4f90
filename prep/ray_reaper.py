"""Kill an embedded Ray's processes the moment the driver that started them dies (kill -9 too).

Why: Ray fate-shares its head processes (gcs_server, raylet, ...) with the driver through
``PR_SET_PDEATHSIG`` (``ray._private.services.start_ray_process``, ``fate_share``), but the
raylet's children are left to notice on their own. The dashboard and runtime-env agents do
notice within ~2 s (``ray._private.process_watcher._check_parent``), then call
``report_raylet_error_logs`` -> ``ray._private.utils.publish_error_to_driver``, which waits a
hard-coded 60 s for the GCS that just died: they stay orphaned ~60 s after a ``kill -9``
(no Ray setting shortens it; ``RAY_enable_pipe_based_agent_to_parent_health_check`` only
changes how the death is seen). Ray's own answer for systems without kernel fate-sharing is
``ray._private.ray_process_reaper``: a process that reads stdin inherited from the driver
and kills the rest when it reads EOF. This is the same idea, limited to the processes
``ray.init`` started (never the driver's process group, which may be a shell's or pytest's):

    driver --pipe--> reaper: records the Ray head processes and their descendants (the
        agents, idle workers), answers one byte (`start_reaper` waits for it, so even a kill
        right after ``ray.init`` finds the tree recorded), then records again every 0.5 s
    driver dies -> EOF -> reaper SIGKILLs every recorded process still alive (same pid and
    start time) and its descendants, then exits.

The tree must be recorded while the raylet lives: once it dies its children are
reparented, and nothing left on them names this session (``setproctitle`` overwrites
their command line and environment). Workers started less than 0.5 s before the end are
not recorded; they exit by themselves within ~2 s of the raylet (measured), unlike the
agents.

Run as ``python -m prep.ray_reaper PID:START...`` (START: /proc start time in clock ticks) with
stdin a pipe the driver holds open.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

POLL_S = 0.5
READY_WAIT_S = 10.0  # the reaper's start (a Python interpreter) on a busy machine
PROC = Path("/proc")


def supported() -> bool:
    """Linux only: the reaper reads the process table from /proc (as Ray's PDEATHSIG is Linux's)."""
    return sys.platform.startswith("linux") and PROC.is_dir()


def start_reaper(ray_processes: dict[int, int]) -> subprocess.Popen[bytes]:
    """Start the reaper for the processes ``ray.init`` started (the driver's new children,
    pid -> start time) and wait until it has recorded their tree (at most `READY_WAIT_S`).

    The driver keeps the write end of the reaper's stdin; no other process inherits it
    (close-on-exec), so the reaper reads EOF exactly when the driver exits, however it exits.
    """
    reaper = subprocess.Popen(
        [sys.executable, "-m", "prep.ray_reaper", *(f"{pid}:{start}" for pid, start in sorted(ray_processes.items()))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver's process group does not reach it
    )
    assert reaper.stdout is not None
    if select.select([reaper.stdout], [], [], READY_WAIT_S)[0]:
        reaper.stdout.read(1)
    return reaper


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc/PID/stat."""
    table = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ... starttime
        table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def children(pid: int) -> dict[int, int]:
    """Direct children of ``pid``: pid -> start time."""
    return {child: start for child, (parent, start) in process_table().items() if parent == pid}


def _record(known: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Add the descendants of every recorded live process as pid -> start time; returns the table."""
    table = process_table()
    alive = [pid for pid, started in known.items() if table.get(pid, (0, -1))[1] == started]
    kids: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        kids.setdefault(parent, []).append(pid)
    while alive:
        for child in kids.get(alive.pop(), ()):
            if child not in known:
                known[child] = table[child][1]
                alive.append(child)
    return table


def _kill(known: dict[int, int]) -> None:
    """SIGKILL every recorded process that is still the one recorded (not a reused pid),
    children born since the last poll included."""
    table = _record(known)
    for pid, started in known.items():
        if pid != os.getpid() and table.get(pid, (0, -1))[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def main(argv: list[str]) -> None:
    known = {int(pid): int(start) for pid, _, start in (a.partition(":") for a in argv)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _record(known)
    os.write(sys.stdout.fileno(), b"1")  # the driver waits for this: the tree is recorded
    while True:
        _record(known)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the driver is gone
    _kill(known)


if __name__ == "__main__":
    main(sys.argv[1:])
