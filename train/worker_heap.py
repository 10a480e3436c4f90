"""Keep a loader worker's heap from fragmenting on pixel buffers.

A worker decodes images and runs the image processor pack after pack: buffers of 1-30 MB
(decoded RGB, resized images, patch arrays) allocated and freed in turn. glibc serves a
freed mmapped block's size and everything smaller from its heap afterwards (its dynamic mmap
threshold climbs to 32 MB), and that heap fragments instead of shrinking: measured here, a
worker shipping uint8 pixels grew from 255 to 612 MB unique memory over 40 packs of 8k
tokens, while with a fixed 1 MB threshold it stayed at ~200 MB (`benchmarks/bench_loader.py`
reports worker RSS). Fixing the threshold sends every buffer of 1 MB or more to mmap, which
returns it to the system when freed. A threshold the user set (``MALLOC_MMAP_THRESHOLD_``)
is left alone; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 1 << 20


def bound_worker_heap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process; True when it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    log.debug("malloc mmap threshold fixed at %d bytes: %s", threshold, done)
    return done
