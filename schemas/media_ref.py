"""The media reference: where a media item's original encoded bytes live.

Written by `prep tokenize` into the tokenized ``media.ref`` column and copied into each
pack's ``json`` member; read back by `prep shards` and `train`. Two forms::

    /data/imgs/a.jpg                a file (absolute once tokenized)
    /data/imgs.lmdb::train/0001.jpg an LMDB environment and a key (value = encoded bytes)

`parse` and `format` are the only places the ``::`` separator is handled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

LMDB_SEPARATOR = "::"


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaRef:
    """A file (``key is None``) or a key inside the LMDB environment at ``path``."""

    path: str
    key: str | None = None

    @classmethod
    def parse(cls, text: str, base_dir: str | None = None) -> MediaRef:
        """Parse a reference; a relative ``path`` is joined to ``base_dir`` when given."""
        path, sep, key = text.partition(LMDB_SEPARATOR)
        if base_dir is not None and not PurePosixPath(path).is_absolute():
            path = str(PurePosixPath(base_dir) / path)
        return cls(path=path, key=key if sep else None)

    def format(self) -> str:
        """The string form stored in tables and pack metadata (inverse of `parse`)."""
        return self.path if self.key is None else f"{self.path}{LMDB_SEPARATOR}{self.key}"

    @property
    def is_lmdb(self) -> bool:
        return self.key is not None

    @property
    def name(self) -> str:
        """Last component of the file path or LMDB key (e.g. to keep the extension)."""
        return (self.key if self.key is not None else self.path).rsplit("/", 1)[-1]
