"""Read ShareGPT dataset files in chunks that workers can fetch independently.

A :class:`Chunk` names a byte range of a JSONL file (or an index range of a JSON array)
plus how many times each of its records is used (``sample_ratio``). The driver plans
chunks by scanning newlines only; workers read and parse just their own range, so a
multi-GB JSONL file is never held in memory and chunks travel to Ray workers as a few
integers, not data.

Every physical line of a JSONL file is a record, blank lines included (a blank line
becomes a ``malformed_json`` error row), so that line numbers in errors match the file.
Chunks and raw records know nothing of the records' layout (ShareGPT, alpaca, ...): that is
the business of the readers in :mod:`prep.sources.formats`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from prep.sources.errors import RecordError
from schemas.dataset_config import ConfigError, DatasetSpec
from schemas.reasons import Reason

SCAN_BLOCK_BYTES = 1 << 22


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """A contiguous run of records of one dataset file, with per-record copy counts."""

    index: int  # global, fixes the output part name and order
    dataset: str
    source: str
    is_jsonl: bool
    first_line: int
    byte_start: int  # JSONL only
    byte_end: int  # JSONL only
    copies: tuple[int, ...]  # uses of each record: 0 (not sampled), 1, 2, ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRecord:
    """One input record before parsing: raw bytes (JSONL) or a parsed object (JSON array)."""

    line: int
    copies: int
    raw: bytes | None = None
    value: object = None


def jsonl_line_offsets(path: Path, every: int) -> tuple[npt.NDArray[np.int64], int]:
    """Byte offsets of lines 0, every, 2*every, ... plus the file size and line count.

    Streams the file in blocks; memory is O(lines / every).
    """
    starts = [0]
    line = 0
    offset = 0
    size = path.stat().st_size
    with open(path, "rb") as fh:
        while block := fh.read(SCAN_BLOCK_BYTES):
            pos = block.find(b"\n")
            while pos != -1:
                line += 1
                if line % every == 0 and offset + pos + 1 < size:
                    starts.append(offset + pos + 1)
                pos = block.find(b"\n", pos + 1)
            offset += len(block)
    num_lines = line + (1 if size and not _ends_with_newline(path) else 0)
    return np.asarray(starts + [size], dtype=np.int64), num_lines


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


def record_copies(num_records: int, ratio: float, seed: int, dataset: str) -> npt.NDArray[np.int64]:
    """How often each record is used: ``floor(ratio)`` copies plus a seeded remainder.

    ratio < 1 keeps a seeded subset of ``round(n * ratio)`` records; the draw depends only
    on (seed, dataset name, n), so reruns select the same records.
    """
    whole = int(np.floor(ratio))
    extra = int(round((ratio - whole) * num_records))
    copies = np.full(num_records, whole, dtype=np.int64)
    if extra:
        name_key = int.from_bytes(dataset.encode("utf-8")[:16].ljust(16, b"\0"), "little")
        rng = np.random.default_rng([seed, name_key])
        copies[rng.choice(num_records, size=extra, replace=False)] += 1
    return copies


def plan_chunks(specs: list[DatasetSpec], *, rows_per_chunk: int, seed: int) -> list[Chunk]:
    """Split every dataset file into chunks of ``rows_per_chunk`` records."""
    chunks: list[Chunk] = []
    for spec in specs:
        path = spec.file_name
        is_jsonl = _is_jsonl(path)
        if is_jsonl:
            offsets, num_records = jsonl_line_offsets(path, rows_per_chunk)
        else:
            num_records = len(_load_json_array(path))
            offsets = np.zeros(0, dtype=np.int64)
        copies = record_copies(num_records, spec.sample_ratio, seed, spec.name)
        for k, first in enumerate(range(0, num_records, rows_per_chunk)):
            last = min(first + rows_per_chunk, num_records)
            chunks.append(
                Chunk(
                    index=len(chunks),
                    dataset=spec.name,
                    source=str(path),
                    is_jsonl=is_jsonl,
                    first_line=first,
                    byte_start=int(offsets[k]) if is_jsonl else 0,
                    byte_end=int(offsets[k + 1]) if is_jsonl else 0,
                    copies=tuple(int(c) for c in copies[first:last]),
                )
            )
    return chunks


def read_chunk(chunk: Chunk) -> Iterator[RawRecord]:
    """Yield the chunk's records that are used at least once."""
    if chunk.is_jsonl:
        with open(chunk.source, "rb") as fh:
            fh.seek(chunk.byte_start)
            data = fh.read(chunk.byte_end - chunk.byte_start)
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        for i, copies in enumerate(chunk.copies):
            if copies:
                yield RawRecord(line=chunk.first_line + i, copies=copies, raw=lines[i])
    else:
        items = _load_json_array(Path(chunk.source))
        for i, copies in enumerate(chunk.copies):
            if copies:
                line = chunk.first_line + i
                yield RawRecord(line=line, copies=copies, value=items[line])


def decode_record(record: RawRecord) -> object:
    """The record's JSON value; undecodable bytes raise :class:`RecordError`."""
    if record.raw is None:
        return record.value
    try:
        text = record.raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(Reason.NOT_UTF8, f"line is not UTF-8: {exc}") from exc
    if not text.strip():
        raise RecordError(Reason.MALFORMED_JSON, "blank line")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(Reason.MALFORMED_JSON, f"invalid JSON: {exc}") from exc


def _is_jsonl(path: Path) -> bool:
    """JSON array files start with '['; everything else is read as JSON lines."""
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return not head.startswith(b"[")


@functools.lru_cache(maxsize=2)
def _load_json_array(path: Path) -> list[object]:
    """Whole-file JSON arrays are loaded once per process; use JSONL for large datasets."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"dataset file {str(path)!r} is not a valid JSON array ({exc}): truncated or corrupt; fix it, or "
            "convert it to JSONL (one record per line), where a bad line becomes an error row"
        ) from exc
    if not isinstance(value, list):
        raise ConfigError(f"dataset file {str(path)!r}: a JSON dataset file must hold an array of records")
    return value
