"""The media reference: where a media item's original encoded bytes live.

Written by `prep tokenize` into the tokenized ``media.ref`` column and copied into each
pack's ``json`` member; read back by `prep shards` and `train`. Three forms::

    /data/imgs/a.jpg                a file (absolute once tokenized)
    /data/imgs.lmdb::train/0001.jpg an LMDB environment and a key (value = encoded bytes)
    /data/train.parquet#row=12&field=images/0/bytes&name=cat.jpg
                                    a cell of a table file (Parquet / Arrow / CSV): the bytes
                                    embedded in row 12 (0-based, of that file), reached from
                                    column ``images`` by list index 0 then struct field
                                    ``bytes`` (the Hugging Face ``datasets`` Image layout)

The table form lets Parquet datasets with embedded images be used without writing the
images out as files: the bytes stay in the table until `prep shards` copies them, unchanged,
into the shard. ``name`` is a file name for the bytes (the Image struct's ``path`` or one
named after the sniffed format) so the shard member keeps a meaningful extension. Field
steps and the name are percent-encoded, so any column name is representable.

`parse` and `format` are the only places these separators are handled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import quote, unquote

LMDB_SEPARATOR = "::"
TABLE_CELL = re.compile(r"^(?P<path>.+)#row=(?P<row>\d+)&field=(?P<field>[^&#]+)&name=(?P<name>[^&#/]*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaRef:
    """A file, a key inside the LMDB environment at ``path``, or a cell of the table file at ``path``.

    Table cells set ``row`` (row index within the file), ``field`` (column, then list
    indices / struct field names, outermost first) and ``cell_name``.
    """

    path: str
    key: str | None = None
    row: int | None = None
    field: tuple[str, ...] = ()
    cell_name: str = ""

    @classmethod
    def table_cell(cls, path: str, row: int, field: tuple[str, ...], name: str = "") -> MediaRef:
        """A reference to bytes embedded in a table file (``name`` loses any directory part)."""
        if not field:
            raise ValueError("a table cell reference needs at least the column name")
        return cls(path=path, row=row, field=tuple(field), cell_name=name.rsplit("/", 1)[-1])

    @classmethod
    def parse(cls, text: str, base_dir: str | None = None) -> MediaRef:
        """Parse a reference; a relative ``path`` is joined to ``base_dir`` when given."""
        cell = TABLE_CELL.match(text)
        if cell is not None:
            path = _join(cell["path"], base_dir)
            steps = tuple(unquote(s) for s in cell["field"].split("/"))
            return cls(path=path, row=int(cell["row"]), field=steps, cell_name=unquote(cell["name"]))
        path, sep, key = text.partition(LMDB_SEPARATOR)
        return cls(path=_join(path, base_dir), key=key if sep else None)

    def format(self) -> str:
        """The string form stored in tables and pack metadata (inverse of `parse`)."""
        if self.row is not None:
            field = "/".join(quote(s, safe="") for s in self.field)
            return f"{self.path}#row={self.row}&field={field}&name={quote(self.cell_name, safe='')}"
        return self.path if self.key is None else f"{self.path}{LMDB_SEPARATOR}{self.key}"

    @property
    def is_lmdb(self) -> bool:
        return self.key is not None

    @property
    def is_table_cell(self) -> bool:
        return self.row is not None

    @property
    def name(self) -> str:
        """Last component of the file path or LMDB key, or the cell's name (e.g. to keep the extension)."""
        if self.row is not None:
            return self.cell_name
        return (self.key if self.key is not None else self.path).rsplit("/", 1)[-1]


def _join(path: str, base_dir: str | None) -> str:
    if base_dir is not None and "://" not in path and not PurePosixPath(path).is_absolute():
        return str(PurePosixPath(base_dir) / path)
    return path
