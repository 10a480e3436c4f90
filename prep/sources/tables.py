"""Parquet / Arrow / CSV dataset files: row counts, row ranges as records, embedded media bytes.

Rows are read in record batches of :data:`BATCH_ROWS` (Parquet: one row group at a time
through pyarrow's buffered streaming reader; Arrow: batches of the
memory-mapped IPC file or stream that ``datasets.save_to_disk`` writes; CSV: pyarrow's
streaming CSV reader), so a file is never held in memory whole.

A row becomes the Python dict the format readers take (``batch.to_pylist()``: lists of
structs -> lists of dicts) with every embedded media value replaced by the string of a
table-cell :class:`~schemas.media_ref.MediaRef`: a binary value, or the ``bytes`` of a Hugging
Face ``datasets`` ``Image`` / ``Video`` struct (``{"bytes": ..., "path": ...}``). A struct with
no bytes becomes its ``path``, which readers resolve against ``media_dir`` like any path.
Example: row 7 of ``/d/train.parquet`` with ``{"images": [{"bytes": b"\\x89PNG...", "path":
"cat.png"}]}`` -> ``{"images": ["/d/train.parquet#row=7&field=images/0/bytes&name=cat.png"]}``.

:func:`cell_bytes` reads such a cell back (tokenize for the header, shards for the bytes);
the last few batches read are cached per process, so tokenize reads each batch once.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from prep.sources.files import is_cloud, open_input
from schemas.dataset_config import ConfigError
from schemas.media_ref import MediaRef

BATCH_ROWS = 64
CACHE_BYTES = 256 << 20  # decoded batches kept per process (the newest is always kept)
MEDIA_STRUCT = frozenset({"bytes", "path"})
MAGIC_NAMES = (
    (b"\xff\xd8\xff", "image.jpg"),
    (b"\x89PNG\r\n\x1a\n", "image.png"),
    (b"GIF8", "image.gif"),
    (b"BM", "image.bmp"),
    (b"II*\x00", "image.tif"),
    (b"MM\x00*", "image.tif"),
)


class TableCellError(LookupError):
    """A table-cell reference that does not lead to bytes (row, column or list index missing, or null)."""


def count_rows(path: str, kind: str) -> int:
    """Rows of a Parquet / Arrow / CSV file (Parquet from the footer; Arrow from batch headers)."""
    if kind == "parquet":
        return int(_parquet(path).metadata.num_rows)
    if kind == "arrow":
        return int(_arrow(path)[1][-1])
    return sum(b.num_rows for b in _csv_batches(path))


def read_rows(path: str, kind: str, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row within the file, record) for rows ``start`` .. ``stop - 1``, in order."""
    for first, batch in _batches(path, kind, start, stop):
        lo, hi = max(start - first, 0), min(stop - first, batch.num_rows)
        rows = batch.slice(lo, hi - lo).to_pylist()
        for i, row in enumerate(rows):
            file_row = first + lo + i
            yield file_row, {k: _embed(v, path, file_row, (k,)) for k, v in row.items()}


def cell_bytes(ref: MediaRef) -> bytes:
    """The original bytes a table-cell reference points at, unchanged."""
    if ref.row is None or not ref.field:
        raise ValueError(f"{ref.format()!r} is not a table-cell reference")
    batch, r = _batch_with_row(ref.path, _kind(ref.path), ref.row, ref.field[0])
    if ref.field[0] not in batch.schema.names:
        raise TableCellError(f"{ref.format()}: no column {ref.field[0]!r}")
    value: Any = batch.column(ref.field[0])[r]
    for step in ref.field[1:]:
        value = _step(value, step, ref)
    if not isinstance(value, pa.BinaryScalar | pa.LargeBinaryScalar) or not value.is_valid:
        raise TableCellError(f"{ref.format()}: not binary data ({value.type})")
    buf = value.as_buffer()
    return buf.to_pybytes() if buf is not None else b""


def _step(value: Any, step: str, ref: MediaRef) -> Any:
    if not value.is_valid:
        raise TableCellError(f"{ref.format()}: null before {step!r}")
    if isinstance(value, pa.ListScalar | pa.LargeListScalar):
        if not step.isdigit() or int(step) >= len(value):
            raise TableCellError(f"{ref.format()}: list has {len(value)} items, asked for {step!r}")
        return value.values[int(step)]
    if isinstance(value, pa.StructScalar) and step in value.keys():
        return value[step]
    raise TableCellError(f"{ref.format()}: no field {step!r} in {value.type}")


def _embed(value: Any, path: str, row: int, field: tuple[str, ...]) -> Any:
    """``value`` with embedded media bytes replaced by table-cell reference strings."""
    if isinstance(value, bytes):
        return MediaRef.table_cell(path, row, field, _sniff_name(value)).format()
    if isinstance(value, dict):
        if set(value) == MEDIA_STRUCT:
            data, name = value["bytes"], value["path"]
            if data is None:
                return name
            hint = name if isinstance(name, str) and "." in name.rsplit("/", 1)[-1] else _sniff_name(data)
            return MediaRef.table_cell(path, row, (*field, "bytes"), hint).format()
        return {k: _embed(v, path, row, (*field, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_embed(v, path, row, (*field, str(i))) for i, v in enumerate(value)]
    return value


def _sniff_name(data: bytes) -> str:
    """A file name for encoded bytes from their magic number (extension only matters)."""
    for magic, name in MAGIC_NAMES:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image.webp"
    if data[4:8] == b"ftyp":
        return "video.mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "video.mkv"
    return ""


def _kind(path: str) -> str:
    kind = path.rsplit(".", 1)[-1].lower()
    return kind if kind in ("parquet", "arrow") else "csv"


# ---- batches --------------------------------------------------------------------------------------

_CACHE: OrderedDict[tuple[str, int, str | None], pa.RecordBatch] = OrderedDict()


def _remember(path: str, first: int, column: str | None, batch: pa.RecordBatch) -> None:
    _CACHE[(path, first, column)] = batch
    _CACHE.move_to_end((path, first, column))
    while len(_CACHE) > 1 and sum(b.nbytes for b in _CACHE.values()) > CACHE_BYTES:
        _CACHE.popitem(last=False)


def _batch_with_row(path: str, kind: str, row: int, column: str) -> tuple[pa.RecordBatch, int]:
    """The cached or freshly read batch holding ``row`` (only ``column`` read on a miss)."""
    for (p, first, col), batch in reversed(_CACHE.items()):
        if p == path and first <= row < first + batch.num_rows and col in (None, column):
            return batch, row - first
    for first, batch in _batches(path, kind, row, row + 1, columns=[column]):
        if first <= row < first + batch.num_rows:
            return batch, row - first
    raise TableCellError(f"{path}: no row {row}")


def _batches(
    path: str, kind: str, start: int, stop: int, columns: list[str] | None = None
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row, batch) of every batch overlapping rows ``start`` .. ``stop - 1``, cached as read."""
    key_col = columns[0] if columns else None
    if kind == "parquet":
        pf = _parquet(path)
        if columns and columns[0] not in pf.schema_arrow.names:
            raise TableCellError(f"{path}: no column {columns[0]!r}")
        starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        for g in range(pf.num_row_groups):
            if starts[g + 1] <= start or starts[g] >= stop:
                continue
            first = int(starts[g])
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=columns, use_threads=False):
                if first + batch.num_rows > start:
                    _remember(path, first, key_col, batch)
                    yield first, batch
                first += batch.num_rows
                if first >= stop:
                    break
    elif kind == "arrow":
        batches, offsets = _arrow(path)
        lo = int(np.searchsorted(offsets, start, side="right")) - 1
        for b in range(max(lo, 0), len(batches)):
            if offsets[b] >= stop:
                break
            yield int(offsets[b]), batches[b]  # zero-copy views of the mapped file: nothing to cache
    else:
        first = 0
        for batch in _csv_batches(path):
            if first + batch.num_rows > start:
                yield first, batch
            first += batch.num_rows
            if first >= stop:
                break


@functools.lru_cache(maxsize=8)
def _parquet(path: str) -> pq.ParquetFile:
    """One open reader per file and process (cloud files through fsspec).

    Not memory-mapped: decoding copies anyway, and mapped pages once read would stay in the
    process's RSS (2 GB file -> ~2.9 GB peak measured); buffered reads keep it to the batches.
    """
    try:
        if is_cloud(path):
            return pq.ParquetFile(open_input(path))
        return pq.ParquetFile(path, memory_map=False, buffer_size=1 << 20)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{path!r} is not a readable Parquet file ({exc})") from exc


@functools.lru_cache(maxsize=8)
def _arrow(path: str) -> tuple[list[pa.RecordBatch], np.ndarray]:
    """Batches of a memory-mapped Arrow IPC file or stream (``save_to_disk`` writes streams) and row offsets."""
    if is_cloud(path):
        raise ConfigError(f"{path!r}: Arrow files are read memory-mapped from local disk; download it first")
    source = pa.memory_map(path)
    try:
        try:
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except pa.ArrowInvalid:
            source.seek(0)
            batches = list(pa.ipc.open_stream(source))
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{path!r} is not a readable Arrow IPC file or stream ({exc})") from exc
    batches = [b for b in batches if b.num_rows]
    return batches, np.cumsum([0] + [b.num_rows for b in batches])


def _csv_batches(path: str) -> Iterator[pa.RecordBatch]:
    """Every column as text (empty cells None), as LLaMA-Factory's pandas-based CSV loading gives text columns."""
    read = pacsv.ReadOptions(block_size=1 << 20)
    try:
        with open_input(path) as fh:
            names = pacsv.open_csv(fh, read_options=read).schema.names
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True)
        with open_input(path) as fh:
            yield from pacsv.open_csv(fh, read_options=read, convert_options=convert)
    except pa.ArrowInvalid as exc:
        raise ConfigError(f"{path!r} is not a readable CSV file ({exc})") from exc
