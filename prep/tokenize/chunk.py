"""One chunk of records -> one samples part and one errors part (Arrow tables).

Conservation inside a chunk: every used (record, copy) pair yields exactly one samples
row or one errors row. A record is tokenized once; its copies share the result.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prep.sources.records import Chunk, RawRecord, read_chunk
from prep.tokenize.conversation import Conversation, to_conversation
from prep.tokenize.core import SampleTokenizer, TokenizedSample
from prep.tokenize.errors import SampleError
from schemas.dataset_config import DatasetSpec
from schemas.reasons import Reason
from schemas.tokenized import ERRORS_SCHEMA, SAMPLES_SCHEMA, make_sample_id


class VerifyMismatch(RuntimeError):
    """Closed-form ids differ from the real processor's: a counter bug. Fails the run."""


@dataclass(kw_only=True, slots=True)
class VerifyPolicy:
    fraction: float = 0.0
    seed: int = 0
    checked: int = 0
    skipped: int = 0

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
    extra: dict[str, Any] = field(default_factory=dict)


def parse_record(raw: RawRecord) -> Any:
    if raw.raw is None:
        return raw.value
    try:
        text = raw.raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SampleError(Reason.NOT_UTF8, f"line is not UTF-8: {exc}") from exc
    if not text.strip():
        raise SampleError(Reason.MALFORMED_JSON, "blank line")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SampleError(Reason.MALFORMED_JSON, f"invalid JSON: {exc}") from exc


def _verify(tok: SampleTokenizer, conv: Conversation, spec: DatasetSpec, sample: TokenizedSample, sid: str) -> bool:
    from prep.tokenize.processor_path import ReferenceUnavailable, reference_input_ids

    try:
        expected = reference_input_ids(tok.bundle, conv, spec.video, tok.lmdb)
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
    rows: dict[str, list] = {f.name: [] for f in SAMPLES_SCHEMA}
    errs: dict[str, list] = {f.name: [] for f in ERRORS_SCHEMA}
    verified = skipped = 0
    for raw in read_chunk(chunk):
        base = {"dataset": chunk.dataset, "source": chunk.source, "line": raw.line}
        try:
            conv = to_conversation(parse_record(raw), spec)
            sample = tok.tokenize(conv, spec.video)
            first_id = make_sample_id(chunk.dataset, raw.line, 0)
            if verify.wants(first_id):
                if _verify(tok, conv, spec, sample, first_id):
                    verified += 1
                else:
                    skipped += 1
        except SampleError as exc:
            for copy in range(raw.copies):
                _append(errs, base, copy, reason=exc.reason.value, message=str(exc))
            continue
        media = [_media_row(uri, c) for uri, c in sample.media]
        for copy in range(raw.copies):
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


def _append(cols: dict[str, list], base: dict[str, Any], copy: int, **values: Any) -> None:
    cols["sample_id"].append(make_sample_id(base["dataset"], base["line"], copy))
    cols["copy"].append(copy)
    for key, value in {**base, **values}.items():
        cols[key].append(value)


def _media_row(uri: str, c: Any) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "ref": uri,
        "width": c.width,
        "height": c.height,
        "grid_t": c.grid_t,
        "grid_h": c.grid_h,
        "grid_w": c.grid_w,
        "num_tokens": c.num_tokens,
        "frame_indices": list(c.frame_indices),
        "timestamps": list(c.timestamps),
    }
