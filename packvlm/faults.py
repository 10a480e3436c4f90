"""Crash points for the kill -9 fault matrix: a process dies exactly where a test asks.

``PACKVLM_CRASH_AT=point[:n]`` SIGKILLs the process at the n-th time (default 1) it passes
``crash_point(point)``; ``PACKVLM_FREEZE_AT=point[:n]`` SIGSTOPs it there instead, so a test
can find the frozen process and kill it from outside (as the OOM killer or a lost node would)
at a known step. Unset (always, outside tests) they do nothing. The stages call it between
their durable steps (after a part or shard, before a manifest), so tests prove a rerun after a
kill at each step ends byte-identical, without racing a timer.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "PACKVLM_CRASH_AT"
FREEZE_ENV = "PACKVLM_FREEZE_AT"
_hits: Counter[tuple[str, str]] = Counter()


def crash_point(point: str) -> None:
    """SIGKILL (``PACKVLM_CRASH_AT``) or SIGSTOP (``PACKVLM_FREEZE_AT``) this process when the
    variable names ``point`` and its count is reached."""
    for env, sig in ((ENV, signal.SIGKILL), (FREEZE_ENV, signal.SIGSTOP)):
        target = os.environ.get(env)
        if not target:
            continue
        name, _, count = target.partition(":")
        if name != point:
            continue
        _hits[env, point] += 1
        if _hits[env, point] >= int(count or 1):
            os.kill(os.getpid(), sig)
