"""The ShareGPT reader: provenance of every record, error reasons, media references.

Truth: the JSONL file written here, line by line.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from prep.sources.conversation import Conversation
from prep.sources.errors import RecordError
from prep.sources.formats.base import reader_for
from prep.sources.formats.sharegpt import to_conversation
from prep.sources.records import plan_chunks
from schemas.dataset_config import ConfigError, DatasetSpec, load_dataset_config
from schemas.media_ref import MediaRef
from schemas.reasons import Reason

GOOD = {
    "messages": [
        {"role": "user", "content": "<image>Compare with <image>."},
        {"role": "assistant", "content": "Same."},
    ],
    "images": ["a.jpg", "db.lmdb::k/1.jpg"],
}


def _spec(tmp_path: Path, lines: list[bytes], ratio: float = 1.0) -> DatasetSpec:
    (tmp_path / "media").mkdir(exist_ok=True)
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cfg = tmp_path / "dataset_info.json"
    cfg.write_text(
        json.dumps(
            {"d": {"file_name": "d.jsonl", "formatting": "sharegpt", "media_dir": "media", "sample_ratio": ratio}}
        )
    )
    return load_dataset_config(cfg)[0]


def _read(spec: DatasetSpec, rows_per_chunk: int = 2) -> list:
    reader = reader_for(spec)
    return [r for c in plan_chunks([spec], rows_per_chunk=rows_per_chunk, seed=0) for r in reader.read(c)]


def test_every_record_carries_its_file_line_and_outcome(tmp_path):
    lines = [
        json.dumps(GOOD).encode(),
        b"",
        b"{not json",
        b'{"messages": "x"}',
        b"\xff\xfe",
        json.dumps({**GOOD, "images": ["a.jpg"]}).encode(),
    ]
    spec = _spec(tmp_path, lines)
    records = _read(spec)
    assert reader_for(spec).convert is to_conversation
    assert [r.line for r in records] == list(range(len(lines)))
    assert {r.source for r in records} == {str(tmp_path / "d.jsonl")}
    reasons = [r.parsed.reason if isinstance(r.parsed, RecordError) else None for r in records]
    assert reasons == [
        None,
        Reason.MALFORMED_JSON,
        Reason.MALFORMED_JSON,
        Reason.EMPTY_CONVERSATION,
        Reason.NOT_UTF8,
        Reason.MEDIA_TAG_MISMATCH,
    ]


def test_media_refs_resolve_against_media_dir(tmp_path):
    spec = _spec(tmp_path, [json.dumps(GOOD).encode()])
    (conv,) = [r.parsed for r in _read(spec)]
    assert isinstance(conv, Conversation)
    media_dir = str(tmp_path / "media")
    assert [(m.kind, m.ref) for m in conv.media] == [
        ("image", MediaRef(path=f"{media_dir}/a.jpg")),
        ("image", MediaRef(path=f"{media_dir}/db.lmdb", key="k/1.jpg")),
    ]
    assert conv.messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Compare with "},
        {"type": "image"},
        {"type": "text", "text": "."},
    ]
    assert conv.messages[1] == {"role": "assistant", "content": "Same."}


def test_copies_follow_sample_ratio(tmp_path):
    spec = _spec(tmp_path, [json.dumps(GOOD).encode()] * 4, ratio=2.0)
    assert [r.copies for r in _read(spec)] == [2, 2, 2, 2]


def test_unknown_formatting_names_the_known_ones(tmp_path):
    spec = replace(_spec(tmp_path, [json.dumps(GOOD).encode()]), formatting="openai")
    with pytest.raises(ConfigError, match="'openai' has no reader; known: \\['alpaca', 'sharegpt'\\]"):
        reader_for(spec)
