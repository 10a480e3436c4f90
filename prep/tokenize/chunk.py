"""One chunk of records -> one samples part and one errors part (Arrow tables).

Records come from the dataset format's reader (:mod:`prep.sources.formats`), so this
module knows no input format. Conservation inside a chunk: every used (record, copy) pair
yields exactly one samples row or one errors row. A record is tokenized once; its copies
share the result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from families.counter import MediaCount
from packvlm.errors import InternalError
from packvlm.sample_error import SampleError
from packvlm.secrets import redact
from prep.sources.conversation import Conversation
from prep.sources.errors import RecordError
from prep.sources.formats.base import reader_for
from prep.sources.records import Chunk
from prep.tokenize.core import SampleTokenizer
from prep.tokenize.processor_path import ReferenceUnavailable, reference_input_ids
from prep.tokenize.sample import TokenizedSample
from schemas.dataset_config import DatasetSpec
from schemas.tokenized import ERRORS_SCHEMA, SAMPLES_SCHEMA, make_sample_id


class VerifyMismatch(InternalError):
    """Closed-form ids differ from the real processor's: a counter bug. Fails the run (unwrapped from Ray)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyPolicy:
    """Which samples ``--verify-fraction`` checks: a seeded draw per sample id."""

    fraction: float = 0.0
    seed: int = 0

    def wants(self, sample_id: str) -> bool:
        if self.fraction <= 0:
            return False
        digest = hashlib.sha256(f"{self.seed}:{sample_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64 < self.fraction


@dataclass(kw_only=True, slots=True)
class ChunkOutput:
    samples: pa.Table
    errors: pa.Table
    verified: int = 0
    verify_skipped: int = 0


def _verify(
    tok: SampleTokenizer, conv: Conversation, spec: DatasetSpec, sample: TokenizedSample, verify: VerifyPolicy, sid: str
) -> bool | None:
    """None: not drawn for verification; False: drawn but the processor is unavailable here."""
    if not verify.wants(sid):
        return None
    try:
        expected = reference_input_ids(tok.bundle, tok.for_template(conv), spec.video, tok.lmdb)
    except ReferenceUnavailable:
        return False
    if expected != sample.input_ids:
        first = next((i for i, (a, b) in enumerate(zip(expected, sample.input_ids)) if a != b), None)
        raise VerifyMismatch(
            f"sample {sid}: closed-form input_ids differ from the processor's "
            f"(len {len(sample.input_ids)} vs {len(expected)}, first difference at {first}).\n"
            f"ours:      {sample.input_ids}\nprocessor: {expected}"
        )
    return True


def process_chunk(chunk: Chunk, spec: DatasetSpec, tok: SampleTokenizer, verify: VerifyPolicy) -> ChunkOutput:
    """Tokenize every used record of the chunk; per-sample failures become error rows."""
    rows: dict[str, list[Any]] = {f.name: [] for f in SAMPLES_SCHEMA}
    errs: dict[str, list[Any]] = {f.name: [] for f in ERRORS_SCHEMA}
    verified = skipped = 0
    for record in reader_for(spec).read(chunk):
        base = {"dataset": chunk.dataset, "source": record.source, "line": record.line}
        if isinstance(record.parsed, RecordError):
            _append_errors(errs, base, record.copies, record.parsed)
            continue
        try:
            tok.check_confined(record.parsed, tuple(str(r) for r in spec.media_roots))
            sample = tok.tokenize(record.parsed, spec.video)
            checked = _verify(tok, record.parsed, spec, sample, verify, make_sample_id(chunk.dataset, record.line, 0))
        except SampleError as exc:
            _append_errors(errs, base, record.copies, exc)
            continue
        verified += checked is True
        skipped += checked is False
        media = [_media_row(ref, count) for ref, count in sample.media]
        for copy in range(record.copies):
            _append(
                rows,
                base,
                copy,
                input_ids=sample.input_ids,
                loss_mask=sample.loss_mask,
                num_tokens=sample.num_tokens,
                num_text_tokens=sample.num_tokens - sample.num_media_tokens,
                num_media_tokens=sample.num_media_tokens,
                media=media,
            )
    return ChunkOutput(
        samples=pa.Table.from_pydict(rows, schema=SAMPLES_SCHEMA),
        errors=pa.Table.from_pydict(errs, schema=ERRORS_SCHEMA),
        verified=verified,
        verify_skipped=skipped,
    )


def _append_errors(
    errs: dict[str, list[Any]], base: dict[str, Any], copies: int, exc: RecordError | SampleError
) -> None:
    for copy in range(copies):
        _append(errs, base, copy, reason=exc.reason.value, message=redact(str(exc)))


def _append(cols: dict[str, list[Any]], base: dict[str, Any], copy: int, **values: Any) -> None:
    cols["sample_id"].append(make_sample_id(base["dataset"], base["line"], copy))
    cols["copy"].append(copy)
    for key, value in {**base, **values}.items():
        cols[key].append(value)


def _media_row(ref: str, count: MediaCount) -> dict[str, Any]:
    return {
        "kind": count.kind,
        "ref": ref,
        "width": count.width,
        "height": count.height,
        "grid_t": count.grid_t,
        "grid_h": count.grid_h,
        "grid_w": count.grid_w,
        "num_tokens": count.num_tokens,
        "frame_indices": list(count.frame_indices),
        "timestamps": list(count.timestamps),
        "num_bytes": count.num_bytes,
        "num_tiles": count.num_tiles,
    }
