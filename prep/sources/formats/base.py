"""What a reader provides, and the registry that finds the reader of a dataset's format.

A reader turns the records of one :class:`~prep.sources.records.Chunk` into
conversations, each with its provenance (source file, 0-based line or row index, how many
times it is used); a record that cannot become a conversation carries a
:class:`~prep.sources.errors.RecordError` instead, so the stage can write an error row and
go on. Readers of every module of this package are registered when the package is imported
(its ``__init__``), which importing this module does first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prep.sources.conversation import Conversation
from prep.sources.errors import RecordError
from prep.sources.records import Chunk, decode_record, read_chunk
from schemas.dataset_config import ConfigError, DatasetSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceRecord:
    """One used input record: where it came from and what it became."""

    source: str  # the dataset file
    line: int  # 0-based record index in the file (the line, for JSONL)
    copies: int  # uses of the record (sample_ratio), >= 1
    parsed: Conversation | RecordError


class RecordReader(Protocol):
    """Reads one dataset's records; built once per dataset spec."""

    def read(self, chunk: Chunk) -> Iterator[SourceRecord]:
        """Every record of the chunk used at least once, in file order."""
        ...


Converter = Callable[[object, DatasetSpec], Conversation]  # one decoded record -> a conversation


@dataclass(frozen=True, slots=True)
class ConvertingReader:
    """The reader of a record format: every record of a chunk through the format's converter."""

    spec: DatasetSpec
    convert: Converter

    def read(self, chunk: Chunk) -> Iterator[SourceRecord]:
        return read_records(chunk, lambda record: self.convert(record, self.spec))


def read_records(chunk: Chunk, convert: Callable[[object], Conversation]) -> Iterator[SourceRecord]:
    """The chunk's used records, each converted; a record the converter refuses carries its error."""
    for raw in read_chunk(chunk):
        try:
            parsed: Conversation | RecordError = convert(decode_record(raw))
        except RecordError as exc:
            parsed = exc
        yield SourceRecord(source=chunk.source, line=raw.line, copies=raw.copies, parsed=parsed)


_REGISTRY: dict[str, Converter] = {}


def register_format(formatting: str, convert: Converter) -> None:
    """Datasets whose spec has this ``formatting`` are read with ``convert``."""
    _REGISTRY[formatting] = convert


def reader_for(spec: DatasetSpec) -> RecordReader:
    """The reader of the spec's ``formatting``, built for that spec."""
    convert = _REGISTRY.get(spec.formatting)
    if convert is None:
        raise ConfigError(
            f"dataset {spec.name!r}: formatting {spec.formatting!r} has no reader; known: {sorted(_REGISTRY)}"
        )
    return ConvertingReader(spec, convert)
