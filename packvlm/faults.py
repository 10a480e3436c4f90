"""Crash points for the kill -9 fault matrix: a process dies exactly where a test asks.

``PACKVLM_CRASH_AT=point[:n]`` SIGKILLs the process at the n-th time (default 1) it passes
``crash_point(point)``; unset (always, outside tests) it does nothing. The stages call it
between their durable steps (after a part or shard, before a manifest), so tests prove a
rerun after a kill at each step ends byte-identical, without racing a timer.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "PACKVLM_CRASH_AT"
_hits: Counter[str] = Counter()


def crash_point(point: str) -> None:
    """SIGKILL this process if ``PACKVLM_CRASH_AT`` names ``point`` and its count is reached."""
    target = os.environ.get(ENV)
    if not target:
        return
    name, _, count = target.partition(":")
    if name != point:
        return
    _hits[point] += 1
    if _hits[point] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
