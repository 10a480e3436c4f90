"""Read what `prep stats` needs from a stage's output directory, column by column.

A tokenized directory (stage ``tokenize``) is read through :mod:`schemas.tokenized`:
memory-mapped parts, only the length columns, ``dataset``, ``media`` (kinds only are
touched) and the errors' ``dataset``/``reason``. A packed directory (stage ``pack``) is read
from its ``manifest.json`` plus, where present, ``pack_stats.arrow`` (one row per pack) and
``pack_stats.json``; token statistics come from its own ``samples/`` parts or, failing
that, from the tokenized directories its manifest names (``inputs: [{"path": ...}]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR
from schemas.manifest import read_manifest
from schemas.tokenized import list_parts, read_column

TOKENIZE_STAGE = "tokenize"
PACK_STAGE = "pack"
PACK_STATS_ARROW = "pack_stats.arrow"
PACK_STATS_JSON = "pack_stats.json"
SAMPLE_COLUMNS = ("dataset", "num_tokens", "num_text_tokens", "num_media_tokens", "media")
ERROR_COLUMNS = ("dataset", "reason")
# Where a pack manifest may name the tokenized directory it planned from.
TOKENIZED_REF_KEYS = ("tokenized", "tokenized_dir", "input", "input_dir", "inputs")


class StatsInputError(ValueError):
    """The directory is not a finished `prep tokenize` or `prep pack` output."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TokenizedTables:
    """Columns of a tokenized directory, zero-copy over the memory-mapped parts.

    Attributes:
        samples: ``dataset``, ``num_tokens``, ``num_text_tokens``, ``num_media_tokens``,
            ``media`` for every sample row.
        errors: ``dataset`` and ``reason`` for every error row.
    """

    samples: pa.Table
    errors: pa.Table


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PackSource:
    """Everything a packed directory says about its packs, as found on disk.

    Attributes:
        manifest: The parsed ``manifest.json`` (stage ``pack``).
        extra: Parsed ``pack_stats.json``, or None.
        per_pack: ``pack_stats.arrow`` (one row per pack), or None.
    """

    manifest: dict[str, Any]
    extra: dict[str, Any] | None
    per_pack: pa.Table | None


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StatsInput:
    """One directory's inputs to `prep stats`.

    Attributes:
        stage: Stage that wrote the directory (``tokenize`` or ``pack``).
        tokenized: Sample and error columns, or None (a packed dir without token data).
        packs: Pack-level data of a packed dir, else None.
    """

    stage: str
    tokenized: TokenizedTables | None
    packs: PackSource | None


def read_input(root: str | Path) -> StatsInput:
    """Read a tokenized or packed directory.

    Raises:
        StatsInputError: No manifest, an unreadable one, or a stage other than tokenize/pack.
    """
    root = Path(root)
    manifest = _manifest(root)
    stage = manifest.get("stage")
    if stage == TOKENIZE_STAGE:
        return StatsInput(stage=stage, tokenized=read_tokenized(root), packs=None)
    if stage == PACK_STAGE:
        packs = PackSource(manifest=manifest, extra=_pack_json(root), per_pack=_pack_arrow(root))
        return StatsInput(stage=stage, tokenized=_tokenized_for_pack(root, manifest), packs=packs)
    raise StatsInputError(f"{root}: manifest stage {stage!r}; `prep stats` reads tokenize or pack output")


def read_tokenized(root: Path) -> TokenizedTables:
    """Only the columns statistics need, memory-mapped, over all completed parts."""
    samples = pa.table({c: read_column(root, c, SAMPLES_DIR) for c in SAMPLE_COLUMNS})
    errors = pa.table({c: read_column(root, c, ERRORS_DIR) for c in ERROR_COLUMNS})
    return TokenizedTables(samples=samples, errors=errors)


def _manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise StatsInputError(f"{root} has no {MANIFEST_FILE}: run `prep tokenize` or `prep pack` to completion first")
    try:
        return read_manifest(path)
    except (ValueError, json.JSONDecodeError) as exc:
        raise StatsInputError(f"{path}: {exc}") from exc


def _pack_json(root: Path) -> dict[str, Any] | None:
    path = root / PACK_STATS_JSON
    if not path.is_file():
        return None
    payload = json.loads(path.read_text(encoding="utf-8"))
    return payload if isinstance(payload, dict) else None


def _pack_arrow(root: Path) -> pa.Table | None:
    """``pack_stats.arrow`` as an IPC file, or else an IPC stream."""
    path = root / PACK_STATS_ARROW
    if not path.is_file():
        return None
    source = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _tokenized_for_pack(root: Path, manifest: dict[str, Any]) -> TokenizedTables | None:
    """Token columns of a packed dir: its own parts, else those of the tokenized dirs it names."""
    if list_parts(root, SAMPLES_DIR):
        return read_tokenized(root)
    found: dict[Path, None] = {}
    for candidate in _referenced_dirs(manifest):
        for path in (Path(candidate), root / candidate):
            if (path / MANIFEST_FILE).is_file() and _stage_of(path) == TOKENIZE_STAGE:
                found.setdefault(path.resolve())
                break
    if not found:
        return None
    tables = [read_tokenized(path) for path in found]
    return TokenizedTables(
        samples=pa.concat_tables([t.samples for t in tables]),
        errors=pa.concat_tables([t.errors for t in tables]),
    )


def _referenced_dirs(manifest: dict[str, Any]) -> list[str]:
    """Paths under the reference keys: strings, lists of strings, or items with a ``path``."""
    found: list[str] = []
    for section in (manifest, manifest.get("config"), manifest.get("inputs")):
        if not isinstance(section, dict):
            continue
        for key in TOKENIZED_REF_KEYS:
            value = section.get(key)
            items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
            for item in items:
                if isinstance(item, dict):
                    item = item.get("path")
                if isinstance(item, str):
                    found.append(item)
    return found


def _stage_of(path: Path) -> str | None:
    try:
        return read_manifest(path / MANIFEST_FILE).get("stage")
    except (ValueError, json.JSONDecodeError):
        return None
