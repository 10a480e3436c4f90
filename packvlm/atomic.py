"""The one way packvlm writes a file: a temp name in the same folder, then a rename.

Readers never see half a file, and a run killed mid-write leaves only ``.tmp-*`` names that
the next run deletes (`clear_stale`). The temp name carries the pid so concurrent writers of
the same target (Ray actors retried after a kill) never share a temp file.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.layout import TMP_PREFIX


def temp_path(final: Path) -> Path:
    """The temp name `final` is written under before its rename."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temp path to write; on success it is renamed to ``final``, on error removed."""
    final = Path(final)
    tmp = temp_path(final)
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(final: str | Path, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(final: str | Path, payload: Any) -> None:
    """Indented JSON with sorted keys (same payload -> same bytes)."""
    write_bytes_atomic(final, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_arrow_atomic(final: str | Path, table: pa.Table) -> None:
    """An uncompressed Arrow IPC file (memory-mappable by readers)."""
    with atomic_path(final) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def clear_stale(folder: Path) -> None:
    """Delete temp files (and temp directories: a checkpoint being written) a killed run left in ``folder``."""
    for stale in folder.glob(f"{TMP_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
