"""Read dataset files in chunks that workers can fetch independently.

A :class:`Chunk` names a contiguous run of records of one dataset file: a byte range of a
JSONL file, an index range of a JSON array, or a row range of a Parquet / Arrow / CSV file
(:mod:`prep.sources.tables`), plus how many times each of its records is used
(``num_samples`` / ``sample_ratio``). The driver plans chunks by scanning newlines or table
footers only; workers read and parse just their own range, so a multi-GB file is never held
in memory and chunks travel to Ray workers as a few integers, not data.

A dataset may span several files (:mod:`prep.sources.files`); its records are numbered
across them in file order, and that number (``line``) makes the sample id.

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
from prep.sources.files import InputFile, dataset_files, open_input
from prep.sources.tables import count_rows, read_rows
from schemas.dataset_config import ConfigError, DatasetSpec
from schemas.reasons import Reason

SCAN_BLOCK_BYTES = 1 << 22
TABLE_KINDS = ("parquet", "arrow", "csv")


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """A contiguous run of records of one dataset file, with per-record copy counts."""

    index: int  # global, fixes the output part name and order
    dataset: str
    source: str  # the file (path or s3:// / gs:// URL)
    kind: str  # "jsonl" | "json" | "parquet" | "arrow" | "csv"
    first_line: int  # record number in the dataset (across its files) of the first record
    file_row: int  # the same record's row (or line) within ``source``
    byte_start: int  # JSONL only
    byte_end: int  # JSONL only
    copies: tuple[int, ...]  # uses of each record: 0 (not sampled), 1, 2, ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRecord:
    """One input record before parsing: raw bytes (JSONL) or a parsed object (JSON array, table row)."""

    line: int
    copies: int
    raw: bytes | None = None
    value: object = None


def jsonl_line_offsets(path: str | Path, every: int) -> tuple[npt.NDArray[np.int64], int]:
    """Byte offsets of lines 0, every, 2*every, ... plus the file size, and the line count.

    Streams the file in blocks; memory is O(lines / every).
    """
    starts = [0]
    line = 0
    offset = 0
    last = b"\n"
    with open_input(str(path)) as fh:
        while block := fh.read(SCAN_BLOCK_BYTES):
            pos = block.find(b"\n")
            while pos != -1:
                line += 1
                if line % every == 0:
                    starts.append(offset + pos + 1)
                pos = block.find(b"\n", pos + 1)
            offset += len(block)
            last = block[-1:]
    size = offset
    if starts[-1] >= size and len(starts) > 1:
        starts.pop()  # the file ends right after a chunk boundary: no empty last chunk
    num_lines = line + (1 if size and last != b"\n" else 0)
    return np.asarray(starts + [size], dtype=np.int64), num_lines


def record_copies(num_records: int, ratio: float, seed: int, dataset: str) -> npt.NDArray[np.int64]:
    """How often each record is used: ``floor(ratio)`` copies plus a seeded remainder.

    ratio < 1 keeps a seeded subset of ``round(n * ratio)`` records; the draw depends only
    on (seed, dataset name, n), so reruns select the same records.
    """
    whole = int(np.floor(ratio))
    extra = int(round((ratio - whole) * num_records))
    copies = np.full(num_records, whole, dtype=np.int64)
    if extra:
        rng = np.random.default_rng([seed, _name_key(dataset)])
        copies[rng.choice(num_records, size=extra, replace=False)] += 1
    return copies


def sample_counts(num_records: int, num_samples: int, seed: int, dataset: str) -> npt.NDArray[np.int64]:
    """LLaMA-Factory's ``num_samples`` (``data/loader.py::_load_single_dataset``), seeded.

    A random permutation cut to ``num_samples`` rows; when more samples than rows are asked,
    every row once plus the rest drawn with replacement. Returns uses per row.
    """
    rng = np.random.default_rng([seed, _name_key(dataset), 1])
    picked = rng.permutation(num_records)[:num_samples]
    if num_samples > num_records and num_records:
        picked = np.concatenate([picked, rng.choice(num_records, size=num_samples - num_records)])
    return np.bincount(picked, minlength=num_records).astype(np.int64)


def dataset_copies(num_records: int, spec: DatasetSpec, seed: int) -> npt.NDArray[np.int64]:
    """Uses of each record: ``num_samples`` picks the rows (as LLaMA-Factory), then ``sample_ratio`` scales them.

    Without ``num_samples`` this is :func:`record_copies`. With both, the ``num_samples``
    picks are the population ``sample_ratio`` draws from: ``num_samples=100, sample_ratio=0.5``
    uses 50 of the 100 picked rows, ``sample_ratio=2`` uses each pick twice.
    """
    num_samples = spec.num_samples
    if num_samples is None:
        return record_copies(num_records, spec.sample_ratio, seed, spec.name)
    picks = sample_counts(num_records, num_samples, seed, spec.name)
    if spec.sample_ratio == 1.0:
        return picks
    rows = np.repeat(np.arange(num_records), picks)
    uses = record_copies(len(rows), spec.sample_ratio, seed, spec.name)
    return np.bincount(rows, weights=uses, minlength=num_records).astype(np.int64)


def _name_key(dataset: str) -> int:
    return int.from_bytes(dataset.encode("utf-8")[:16].ljust(16, b"\0"), "little")


def spec_files(spec: DatasetSpec) -> list[InputFile]:
    """The files of a dataset entry (``cloud_file_name`` wins over ``file_name``, as in LLaMA-Factory)."""
    location = spec.cloud_file_name or str(spec.file_name)
    return dataset_files(location, spec.split, f"dataset {spec.name!r}")


def plan_chunks(specs: list[DatasetSpec], *, rows_per_chunk: int, seed: int) -> list[Chunk]:
    """Split every dataset file into chunks of at most ``rows_per_chunk`` records."""
    chunks: list[Chunk] = []
    for spec in specs:
        files = [(f, *_file_rows(f, rows_per_chunk)) for f in spec_files(spec)]
        copies = dataset_copies(sum(n for _, _, n in files), spec, seed)
        first = 0
        for f, offsets, num_records in files:
            for k, row in enumerate(range(0, num_records, rows_per_chunk)):
                last = min(row + rows_per_chunk, num_records)
                chunks.append(
                    Chunk(
                        index=len(chunks),
                        dataset=spec.name,
                        source=f.path,
                        kind=f.kind,
                        first_line=first + row,
                        file_row=row,
                        byte_start=int(offsets[k]) if f.kind == "jsonl" else 0,
                        byte_end=int(offsets[k + 1]) if f.kind == "jsonl" else 0,
                        copies=tuple(int(c) for c in copies[first + row : first + last]),
                    )
                )
            first += num_records
    return chunks


def _file_rows(f: InputFile, every: int) -> tuple[npt.NDArray[np.int64], int]:
    """JSONL chunk byte offsets (empty for other kinds) and the file's record count."""
    if f.kind == "jsonl":
        return jsonl_line_offsets(f.path, every)
    empty = np.zeros(0, dtype=np.int64)
    if f.kind == "json":
        return empty, len(_load_json_array(f.path))
    return empty, count_rows(f.path, f.kind)


def read_chunk(chunk: Chunk) -> Iterator[RawRecord]:
    """Yield the chunk's records that are used at least once."""
    if chunk.kind == "jsonl":
        with open_input(chunk.source) as fh:
            fh.seek(chunk.byte_start)
            data = fh.read(chunk.byte_end - chunk.byte_start)
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        for i, copies in enumerate(chunk.copies):
            if copies:
                yield RawRecord(line=chunk.first_line + i, copies=copies, raw=lines[i])
    elif chunk.kind == "json":
        items = _load_json_array(chunk.source)
        for i, copies in enumerate(chunk.copies):
            if copies:
                yield RawRecord(line=chunk.first_line + i, copies=copies, value=items[chunk.file_row + i])
    else:
        stop = chunk.file_row + len(chunk.copies)
        for row, value in read_rows(chunk.source, chunk.kind, chunk.file_row, stop):
            copies = chunk.copies[row - chunk.file_row]
            if copies:
                yield RawRecord(line=chunk.first_line + row - chunk.file_row, copies=copies, value=value)


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


@functools.lru_cache(maxsize=2)
def _load_json_array(path: str) -> list[object]:
    """Whole-file JSON arrays are loaded once per process; use JSONL for large datasets."""
    try:
        with open_input(path) as fh:
            value = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"dataset file {str(path)!r} is not a valid JSON array ({exc}): truncated or corrupt; fix it, or "
            "convert it to JSONL (one record per line), where a bad line becomes an error row"
        ) from exc
    if not isinstance(value, list):
        raise ConfigError(f"dataset file {str(path)!r}: a JSON dataset file must hold an array of records")
    return value
