"""Reading what a shard needs: rows of memory-mapped tokenized parts and media bytes.

A shard task carries (part id, row) pairs, never data; each process maps a part once and
slices ``input_ids``/``loss_mask`` straight out of the Arrow buffers (zero copy until the
pack's arrays are concatenated). Media come from files, LMDB or table cells (bytes embedded
in Parquet / Arrow files, copied unchanged) exactly as tokenize read them; a reference that
vanished since then is a hard error naming sample and path.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from packvlm.errors import DataBudgetError
from prep.sources.media import LmdbPool, MediaError, read_bytes
from schemas.media_ref import MediaRef
from schemas.tokenized import TokenizedPartError, open_part


class MediaVanishedError(DataBudgetError):
    """A media file or LMDB key that tokenize read is gone: restore it or re-tokenize."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleRow:
    """One tokenized sample, arrays as read-only views into the mapped part."""

    sample_id: str
    dataset: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    media: list[dict]


class PartView:
    """Row access into one memory-mapped part (one or several record batches)."""

    def __init__(self, path: str) -> None:
        self.path = path
        table = open_part(path)
        self._batches = [b for b in table.to_batches() if b.num_rows]
        self._starts: list[int] = np.cumsum([0] + [b.num_rows for b in self._batches]).tolist()
        self._arrays = [self._list_arrays(b) for b in self._batches]
        self._py: dict[int, tuple[list, list, list]] = {}  # batch -> ids, datasets, media

    def _python_columns(self, b: int) -> tuple[list, list, list]:
        """Small columns of a batch as Python lists, converted once (per-row scalars are slow)."""
        if b not in self._py:
            batch = self._batches[b]
            ids, datasets, media = (batch.column(c).to_pylist() for c in ("sample_id", "dataset", "media"))
            self._py[b] = (ids, datasets, media)
        return self._py[b]

    @staticmethod
    def _list_arrays(batch: pa.RecordBatch) -> tuple[np.ndarray, ...]:
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        return (
            ids.offsets.to_numpy(),
            ids.values.to_numpy(),
            mask.offsets.to_numpy(),
            mask.values.to_numpy(),
            batch.column("num_tokens").to_numpy(),
        )

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    def row(self, index: int) -> SampleRow:
        if not 0 <= index < self.num_rows:
            raise TokenizedPartError(
                f"{self.path} has {self.num_rows} rows, the plan names row {index}: inputs changed; rerun `prep "
                "pack` into a new directory"
            )
        b = bisect.bisect_right(self._starts, index) - 1  # per row: numpy's call overhead is ~30x a bisect
        r = index - self._starts[b]
        id_off, ids, mask_off, mask, num_tokens = self._arrays[b]
        sample_ids, datasets, media = self._python_columns(b)
        row = SampleRow(
            sample_id=sample_ids[r],
            dataset=datasets[r],
            input_ids=ids[id_off[r] : id_off[r + 1]],
            loss_mask=mask[mask_off[r] : mask_off[r + 1]],
            media=media[r],
        )
        if row.input_ids.size != num_tokens[r] or row.loss_mask.size != num_tokens[r]:
            raise TokenizedPartError(
                f"{self.path} row {index} ({row.sample_id}): input_ids/loss_mask length differs from "
                "num_tokens; the part is corrupt"
            )
        return row


def read_media(ref: str, sample_id: str, pool: LmdbPool) -> bytes:
    """Original encoded bytes of a media item (``ref`` as tokenize recorded it: absolute)."""
    try:
        return read_bytes(MediaRef.parse(ref), pool)
    except MediaError as exc:
        raise MediaVanishedError(f"sample {sample_id}: media {ref!r} vanished since tokenize ({exc})") from exc
