"""The tokenized directories `prep pack` reads, checked against their manifests.

Only small columns are read (memory-mapped): ``num_tokens``, ``num_media_tokens``,
``sample_id`` and, per media item, its length and ``num_bytes``; token lists are never
materialised. Samples of all inputs are numbered globally in input order, then part order,
then row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packvlm.errors import UsageError
from schemas.layout import MANIFEST_FILE, SAMPLES_DIR, part_name
from schemas.manifest import PackInput, TokenizeManifest, file_sha256, read_manifest
from schemas.tokenized import TokenizedPartError, open_part, read_column


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedInput:
    """One `prep tokenize` output directory, its parts in order and their row counts."""

    root: str
    manifest_sha256: str
    manifest: TokenizeManifest
    parts: tuple[str, ...]  # file names under samples/
    part_rows: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        return sum(self.part_rows)

    def pack_input(self) -> PackInput:
        """How the pack manifest records this input."""
        return PackInput(
            path=self.root,
            manifest_sha256=self.manifest_sha256,
            processor=self.manifest.processor,
            samples=self.num_samples,
        )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SampleColumns:
    """Per-sample arrays over all inputs (global sample order)."""

    num_tokens: np.ndarray
    num_media_tokens: np.ndarray
    media_count: np.ndarray
    media_bytes: np.ndarray  # encoded bytes of the sample's media, recorded at tokenize time
    input_index: np.ndarray  # which input
    part_index: np.ndarray  # which part of that input
    row: np.ndarray  # row within the part
    sample_ids: list[pa.ChunkedArray]  # per input


def load_input(root: str | Path) -> TokenizedInput:
    """Check a tokenized directory against its manifest: every part present and readable.

    Raises:
        ManifestError: No manifest, another stage's, or an unknown version.
        TokenizedPartError: A missing or truncated part, or a row count that differs from
            the manifest.
    """
    root = Path(root).resolve()
    manifest_path = root / MANIFEST_FILE
    manifest = read_manifest(manifest_path, TokenizeManifest)
    expected = [part_name(i) for i in range(manifest.inputs.chunks)]
    folder = root / SAMPLES_DIR
    missing = [name for name in expected if not (folder / name).is_file()]
    if missing:
        raise TokenizedPartError(
            f"{root}: tokenized parts {missing[:5]} are missing ({len(missing)} of {len(expected)}); rerun "
            "`prep tokenize` with the same options to restore them"
        )
    rows = tuple(open_part(folder / name).num_rows for name in expected)
    if sum(rows) != manifest.rows.samples:
        raise TokenizedPartError(
            f"{root}: parts hold {sum(rows)} samples, manifest says {manifest.rows.samples}; rerun `prep tokenize`"
        )
    return TokenizedInput(
        root=str(root),
        manifest_sha256=file_sha256(manifest_path),
        manifest=manifest,
        parts=tuple(expected),
        part_rows=rows,
    )


def _ints(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return column.to_numpy().astype(np.int64) if len(column) else np.zeros(0, np.int64)


class MixedProcessorsError(UsageError, ValueError):
    """Inputs tokenized with different processor classes cannot share packs (one model trains on them)."""


def check_same_processor(inputs: list[TokenizedInput]) -> None:
    """Refuse to pack inputs tokenized for different model families together."""
    classes = {i.manifest.processor.class_name for i in inputs}
    if len(classes) > 1:
        listing = ", ".join(f"{i.root}: {i.manifest.processor.class_name}" for i in inputs)
        raise MixedProcessorsError(
            f"inputs were tokenized with different processor classes ({listing}); pack each model's data separately"
        )


def _media_bytes(media: pa.ChunkedArray) -> np.ndarray:
    """Total encoded media bytes per sample from the ``media.num_bytes`` field."""
    flat = pc.list_flatten(media)
    if not len(flat):
        return np.zeros(len(media), np.int64)
    parents = pc.list_parent_indices(media).to_numpy()
    sizes = _ints(pc.struct_field(flat, "num_bytes"))
    return np.bincount(parents, weights=sizes, minlength=len(media)).astype(np.int64)


def load_columns(inputs: list[TokenizedInput]) -> SampleColumns:
    """Length columns and row locations of every sample, memory-mapped."""
    tokens, media_tokens, media_count, media_bytes, input_index, part_index, row, ids = ([] for _ in range(8))
    for i, item in enumerate(inputs):
        tokens.append(_ints(read_column(item.root, "num_tokens")))
        if tokens[-1].size != item.num_samples:
            raise TokenizedPartError(
                f"{item.root}: {SAMPLES_DIR}/ holds parts the manifest does not list; rerun `prep tokenize`"
            )
        media = read_column(item.root, "media")
        media_tokens.append(_ints(read_column(item.root, "num_media_tokens")))
        media_count.append(_ints(pc.list_value_length(media)))
        media_bytes.append(_media_bytes(media))
        ids.append(read_column(item.root, "sample_id"))
        input_index.append(np.full(item.num_samples, i, np.int64))
        counts = np.asarray(item.part_rows, np.int64)
        part_index.append(np.repeat(np.arange(counts.size), counts))
        row.append(np.arange(item.num_samples) - np.repeat(np.cumsum(counts) - counts, counts))

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)

    return SampleColumns(
        num_tokens=cat(tokens),
        num_media_tokens=cat(media_tokens),
        media_count=cat(media_count),
        media_bytes=cat(media_bytes),
        input_index=cat(input_index),
        part_index=cat(part_index),
        row=cat(row),
        sample_ids=ids,
    )
