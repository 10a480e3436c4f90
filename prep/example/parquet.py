"""``prep example OUT --parquet``: the example's ``chat`` rows again as a ``datasets``-style Parquet file.

Hugging Face ``datasets`` stores an ``Image`` feature as a struct ``{bytes, path}``; most
public VLM SFT sets come that way. This writes ``data/chat.parquet`` with the ``chat``
dataset's rows, every image file's bytes embedded in the ``images`` column (``path`` keeps
the file name), and adds a ``chat_parquet`` entry to ``dataset_info.json`` beside ``chat``:
same columns, tags and media settings, so both tokenize to the same ids. Rows that are not
JSON objects of the expected shape (the deliberately bad ones) are left out; images that are
not plain files (missing files, LMDB keys) keep only their ``path`` and are read as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.media_ref import MediaRef

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(IMAGE)),
        ("videos", pa.list_(pa.string())),
    ]
)
ROW_GROUP_ROWS = 100  # as datasets writes image data


def add_parquet_entry(config_path: Path, source: str = "chat", name: str = "chat_parquet") -> Path:
    """Write ``data/<source>.parquet`` from the ``source`` entry and register it as ``name``; returns the file."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    entry = config[source]
    base = config_path.parent
    media_dir = (base / entry.get("media_dir", ".")).resolve()
    lines = (base / entry["file_name"]).read_bytes().split(b"\n")  # the bad rows include a non-UTF-8 line
    rows = [_row(line, media_dir) for line in lines]
    out = (base / entry["file_name"]).with_suffix(".parquet")
    table = pa.Table.from_pylist([r for r in rows if r is not None], schema=SCHEMA)
    pq.write_table(table, out, row_group_size=ROW_GROUP_ROWS)
    config[name] = {**entry, "file_name": str(out.relative_to(base))}
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def _row(line: bytes, media_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    messages, images, videos = record.get("messages"), record.get("images") or [], record.get("videos") or []
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        return None
    if not all(isinstance(p, str) for p in [*images, *videos]):
        return None
    return {
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "images": [_image(p, media_dir) for p in images],
        "videos": videos,
    }


def _image(path: str, media_dir: Path) -> dict[str, Any]:
    file = media_dir / path
    if not MediaRef.parse(path).is_lmdb and file.is_file():
        return {"bytes": file.read_bytes(), "path": file.name}
    return {"bytes": None, "path": path}
