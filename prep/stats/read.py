"""Read what `prep stats` needs from a stage's output directory, through `schemas/` only.

The directory's ``manifest.json`` says which stage wrote it (`schemas.manifest.read_any_manifest`):

- ``tokenize`` (`TokenizeManifest`): the parts its manifest counts, memory-mapped, only
  the length columns, ``dataset``, ``media`` (kinds only are touched) and the errors'
  ``dataset``/``reason`` (plus, for a few example rows only, where they came from and
  their message); row counts must match the manifest.
- ``pack`` (`PackManifest`): its manifest, ``pack_stats.arrow`` (one row per pack, must
  agree with the manifest), ``shards.json`` when the shards are complete
  (`read_packed_output`), and the token columns of the tokenized inputs its manifest pins,
  when each is still there with the manifest sha256 it was packed from. A missing section
  becomes a note in the report, never a guess.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from packvlm.errors import UsageError
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR, part_name
from schemas.manifest import (
    ManifestError,
    PackManifest,
    ShardsManifest,
    TokenizeManifest,
    file_sha256,
    read_any_manifest,
    read_manifest,
)
from schemas.packed import PACK_STATS_FILE, PACK_STATS_SCHEMA, IncompleteShardsError, read_packed_output
from schemas.stages import Stage
from schemas.tokenized import ERRORS_SCHEMA, SAMPLES_SCHEMA, open_part

SAMPLE_COLUMNS = ("dataset", "num_tokens", "num_text_tokens", "num_media_tokens", "media")
ERROR_COLUMNS = ("dataset", "reason", "sample_id", "source", "line", "copy", "message")


class StatsInputError(UsageError, ValueError):
    """The directory is not a finished, consistent `prep tokenize` or `prep pack` output."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TokenizedTables:
    """Columns of tokenized directories, zero-copy over the memory-mapped parts.

    Attributes:
        samples: ``dataset``, ``num_tokens``, ``num_text_tokens``, ``num_media_tokens``,
            ``media`` for every sample row.
        errors: ``dataset``, ``reason``, ``sample_id``, ``source``, ``line``, ``copy`` and
            ``message`` for every error row (the last five are read for examples only).
    """

    samples: pa.Table
    errors: pa.Table


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PackedTables:
    """A packed directory's pack data.

    Attributes:
        manifest: Its ``manifest.json``.
        shards: Its ``shards.json`` when the shards of this plan are complete, else None.
        per_pack: ``pack_stats.arrow``, one row per pack (`PACK_STATS_SCHEMA`).
    """

    manifest: PackManifest
    shards: ShardsManifest | None
    per_pack: pa.Table


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StatsInput:
    """One directory's inputs to `prep stats`.

    Attributes:
        stage: Stage that wrote the directory.
        tokenized: Sample and error columns, or None (a packed dir whose inputs are gone).
        packed: Pack data of a packed dir, else None.
        notes: Why a section is missing.
    """

    stage: Stage
    tokenized: TokenizedTables | None
    packed: PackedTables | None
    notes: tuple[str, ...] = ()


def read_input(root: str | Path) -> StatsInput:
    """Read a tokenized or packed directory.

    Raises:
        StatsInputError: No manifest, an unreadable one, another stage's, or files that
            disagree with it.
    """
    root = Path(root)
    try:
        manifest = read_any_manifest(root / MANIFEST_FILE, (TokenizeManifest, PackManifest))
        if isinstance(manifest, TokenizeManifest):
            return StatsInput(stage=Stage.TOKENIZE, tokenized=read_tokenized(root, manifest), packed=None)
        if isinstance(manifest, PackManifest):
            return _read_packed(root, manifest)
    except ManifestError as exc:
        raise StatsInputError(str(exc)) from exc
    raise StatsInputError(f"{root}: `prep stats` reads tokenize or pack output, not {type(manifest).__name__}")


def read_tokenized(root: Path, manifest: TokenizeManifest) -> TokenizedTables:
    """Only the columns statistics need, over exactly the parts the manifest counts."""
    chunks = manifest.inputs.chunks
    samples = _columns(root, SAMPLES_DIR, chunks, SAMPLES_SCHEMA, SAMPLE_COLUMNS, manifest.rows.samples)
    errors = _columns(root, ERRORS_DIR, chunks, ERRORS_SCHEMA, ERROR_COLUMNS, manifest.rows.errors)
    return TokenizedTables(samples=samples, errors=errors)


def _columns(root: Path, table: str, parts: int, schema: pa.Schema, columns: tuple[str, ...], rows: int) -> pa.Table:
    paths = [root / table / part_name(i) for i in range(parts)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise StatsInputError(
            f"{root / table}: parts {missing[:3]} of {parts} are missing; rerun `prep tokenize` to restore them"
        )
    empty = pa.schema([schema.field(c) for c in columns]).empty_table()
    progress = tqdm(paths, desc=f"read {table}", unit="part", disable=not sys.stderr.isatty())
    out = pa.concat_tables([empty, *(open_part(p).select(list(columns)) for p in progress)])
    if out.num_rows != rows:
        raise StatsInputError(f"{root / table}: parts hold {out.num_rows} rows, the manifest says {rows}")
    return out


def _read_packed(root: Path, manifest: PackManifest) -> StatsInput:
    notes: list[str] = []
    try:
        shards: ShardsManifest | None = read_packed_output(root).shards
    except IncompleteShardsError as exc:
        shards = None
        notes.append(f"shards: {exc}")
    packed = PackedTables(manifest=manifest, shards=shards, per_pack=_pack_table(root, manifest))
    tokenized = _tokenized_inputs(manifest, notes)
    return StatsInput(stage=Stage.PACK, tokenized=tokenized, packed=packed, notes=tuple(notes))


def _pack_table(root: Path, manifest: PackManifest) -> pa.Table:
    """``pack_stats.arrow``, checked against its schema and the manifest's pack count."""
    path = root / PACK_STATS_FILE
    if not path.is_file():
        raise StatsInputError(f"{path} is missing: rerun `prep pack` with the same options to restore it")
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    for field in PACK_STATS_SCHEMA:
        if table.schema.get_field_index(field.name) < 0 or table.schema.field(field.name).type != field.type:
            raise StatsInputError(f"{path}: column {field.name} ({field.type}) missing; rerun `prep pack`")
    if table.num_rows != manifest.packs.packs:
        raise StatsInputError(
            f"{path} has {table.num_rows} packs, {root / MANIFEST_FILE} {manifest.packs.packs}: rerun `prep pack`"
        )
    return table


def _tokenized_inputs(manifest: PackManifest, notes: list[str]) -> TokenizedTables | None:
    """Token columns of every input as packed; None (and a note) if one is gone or changed."""
    tables = []
    for item in manifest.inputs:
        path = Path(item.path) / MANIFEST_FILE
        if not path.is_file():
            notes.append(f"token statistics skipped: tokenized input {item.path} is not there")
            return None
        if file_sha256(path) != item.manifest_sha256:
            notes.append(f"token statistics skipped: tokenized input {item.path} changed after it was packed")
            return None
        tables.append(read_tokenized(Path(item.path), read_manifest(path, TokenizeManifest)))
    if not tables:
        return None
    return TokenizedTables(
        samples=pa.concat_tables([t.samples for t in tables]),
        errors=pa.concat_tables([t.errors for t in tables]),
    )
