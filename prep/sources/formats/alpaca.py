"""Alpaca records -> conversations (LLaMA-Factory ``formatting: alpaca``, its default).

The conversion is LLaMA-Factory's ``AlpacaDatasetConverter``
(``src/llamafactory/data/converter.py``): each ``history`` pair ``[prompt, response]``
becomes a user and an assistant turn, then the user turn is ``prompt`` and ``query`` joined
by ``"\\n"`` (each only when non-empty), then the assistant turn is ``response``; ``system``
and ``tools`` come from their columns. ``<image>``/``<video>`` tags in any user text take the
row's ``images``/``videos`` entries in order, exactly as in ShareGPT records
(:mod:`prep.sources.formats.content`), so counting, masking and packing are the same. History
responses are trained on too, as LLaMA-Factory does.

Example: ``{"instruction": "<image>What is it?", "input": "Be brief.", "output": "A cat.",
"images": ["a.jpg"]}`` -> ``[{"role": "user", "content": [{"type": "image"}, {"type":
"text", "text": "What is it?\\nBe brief."}]}, {"role": "assistant", "content": "A cat."}]``.
"""

from __future__ import annotations

from typing import Any

from prep.sources.conversation import Conversation, Message
from prep.sources.errors import RecordError
from prep.sources.formats.base import register_format
from prep.sources.formats.content import MediaCursor, media_list
from prep.sources.formats.tools import parse_tools
from schemas.dataset_config import DatasetSpec
from schemas.reasons import Reason


def to_conversation(record: object, spec: DatasetSpec) -> Conversation:
    """Validate an alpaca record and turn it into chat-template messages."""
    if not isinstance(record, dict):
        raise RecordError(Reason.BAD_RECORD, f"record must be a JSON object, got {type(record).__name__}")
    columns = spec.columns
    cursor = MediaCursor(
        spec=spec,
        images=media_list(record, columns.images, spec, "image"),
        videos=media_list(record, columns.videos, spec, "video"),
    )
    messages: list[Message] = []
    system = _text(record, columns.system)
    if system:
        messages.append({"role": "system", "content": system})
    for prompt, response in _history(record, columns.history):
        messages.append({"role": "user", "content": cursor.content("user", prompt)})
        messages.append({"role": "assistant", "content": cursor.content("assistant", response)})
    query = "\n".join(t for t in (_text(record, columns.prompt), _text(record, columns.query)) if t)
    messages.append({"role": "user", "content": cursor.content("user", query)})
    answer = record.get(columns.response) if columns.response else None
    if not isinstance(answer, str):
        raise RecordError(
            Reason.EMPTY_CONVERSATION, f"no response: column {columns.response!r} must hold the answer text"
        )
    messages.append({"role": "assistant", "content": cursor.content("assistant", answer)})
    cursor.check_all_used()
    tools = parse_tools(record.get(columns.tools)) if columns.tools else None
    return Conversation(messages=messages, media=cursor.media, tools=tools)


def _text(record: dict[str, Any], column: str | None) -> str:
    """A text column's value; absent or null is empty (LLaMA-Factory skips falsy values)."""
    value = record.get(column) if column else None
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(Reason.BAD_RECORD, f"column {column!r} must be text, got {type(value).__name__}")
    return value


def _history(record: dict[str, Any], column: str | None) -> list[tuple[str, str]]:
    value = record.get(column) if column else None
    if not value:
        return []
    pairs = value if isinstance(value, list) else None
    if pairs is None or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in pairs
    ):
        raise RecordError(Reason.BAD_RECORD, f"column {column!r} must be a list of [prompt, response] text pairs")
    return [(p[0], p[1]) for p in pairs]


register_format("alpaca", to_conversation)
