"""Arrow schemas of `prep tokenize` output: the samples table and the errors table.

Both are written as Arrow IPC *files* (uncompressed, memory-mappable with
``pyarrow.memory_map``), one part per input chunk, under ``samples/`` and ``errors/``
(see :mod:`schemas.layout`). A later stage plans from the ``num_tokens`` column alone.

Example samples row (Qwen2-VL, one 448x448 image)::

    sample_id        "llava:17:0"        dataset:line:copy, unique within a run
    dataset          "llava"
    source           "data/llava.jsonl"
    line             17                   0-based index of the record in its file
    copy             0                    repeat index when sample_ratio > 1
    input_ids        [151644, 8948, ...]  exactly the processor's input_ids
    loss_mask        [0, 0, ..., 1, 1]    1 on tokens the assistant turns render
    num_tokens       312 = num_text_tokens + num_media_tokens
    num_text_tokens  56
    num_media_tokens 256
    media            [{kind: "image", ref: "imgs/a.jpg", width: 448, height: 448,
                       grid_t: 1, grid_h: 32, grid_w: 32, num_tokens: 256,
                       frame_indices: [], timestamps: [], num_bytes: 48213}]
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from packvlm.errors import DataBudgetError
from schemas.layout import PART_SUFFIX, SAMPLES_DIR

TOKENIZED_SCHEMA_VERSION = 3  # 2: media.num_bytes; 3: media.num_tiles

MEDIA_TYPE = pa.struct(
    [
        pa.field("kind", pa.string(), nullable=False),  # "image" | "video"
        pa.field("ref", pa.string(), nullable=False),  # a schemas.media_ref.MediaRef, formatted
        pa.field("width", pa.int32(), nullable=False),  # after EXIF orientation
        pa.field("height", pa.int32(), nullable=False),
        pa.field("grid_t", pa.int32(), nullable=False),  # processor grid, patches
        pa.field("grid_h", pa.int32(), nullable=False),
        pa.field("grid_w", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),  # placeholder tokens emitted
        pa.field("frame_indices", pa.list_(pa.int32()), nullable=False),  # video only
        pa.field("timestamps", pa.list_(pa.float32()), nullable=False),  # seconds, video only
        pa.field("num_bytes", pa.int64(), nullable=False),  # encoded size (file or LMDB value), v2
        # image arrays the processor makes of the item: tiles/crops + thumbnail/global view, v3
        pa.field("num_tiles", pa.int32(), nullable=False),
    ]
)

SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),
        pa.field("copy", pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_text_tokens", pa.int32(), nullable=False),
        pa.field("num_media_tokens", pa.int32(), nullable=False),
        pa.field("media", pa.list_(MEDIA_TYPE), nullable=False),
    ],
    metadata={"packvlm.schema": "tokenized.samples", "packvlm.version": str(TOKENIZED_SCHEMA_VERSION)},
)

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),
        pa.field("copy", pa.int32(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # a schemas.reasons.Reason value
        pa.field("message", pa.string(), nullable=False),
    ],
    metadata={"packvlm.schema": "tokenized.errors", "packvlm.version": str(TOKENIZED_SCHEMA_VERSION)},
)


def make_sample_id(dataset: str, line: int, copy: int) -> str:
    """Stable id of one (record, repeat) pair; the same input always gets the same id."""
    return f"{dataset}:{line}:{copy}"


def list_parts(root: str | Path, table: str = SAMPLES_DIR) -> list[Path]:
    """Completed part files of one table of a tokenized directory, in part order.

    Temporary files of an interrupted write are never listed.
    """
    folder = Path(root) / table
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"part-*{PART_SUFFIX}"))


class TokenizedPartError(DataBudgetError):
    """A tokenized part is missing, truncated or differs from its manifest: rerun `prep tokenize`."""


def open_part(path: str | Path) -> pa.Table:
    """Memory-map one part (Arrow IPC file) without copying it into RAM.

    Raises:
        TokenizedPartError: The file is missing, truncated or not an Arrow IPC file.
    """
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except FileNotFoundError as exc:
        raise TokenizedPartError(f"tokenized part {path} is missing; rerun `prep tokenize` on its directory") from exc
    except (pa.ArrowInvalid, OSError) as exc:
        raise TokenizedPartError(
            f"tokenized part {path} is unreadable or truncated ({exc}); rerun `prep tokenize`"
        ) from exc
    version = (table.schema.metadata or {}).get(b"packvlm.version", b"?").decode()
    if version != str(TOKENIZED_SCHEMA_VERSION):
        raise TokenizedPartError(
            f"tokenized part {path} has format version {version}, this packvlm reads version "
            f"{TOKENIZED_SCHEMA_VERSION}; rerun `prep tokenize` with this packvlm"
        )
    return table


def read_column(root: str | Path, column: str, table: str = SAMPLES_DIR) -> pa.ChunkedArray:
    """One column over all parts, memory-mapped; e.g. ``num_tokens`` for planning packs."""
    chunks = []
    for part in list_parts(root, table):
        chunks.extend(open_part(part).column(column).chunks)
    schema = SAMPLES_SCHEMA if table == SAMPLES_DIR else ERRORS_SCHEMA
    return pa.chunked_array(chunks, type=schema.field(column).type)
