"""ShareGPT records -> conversations (LLaMA-Factory ``formatting: sharegpt``).

Both spellings are accepted: ``{"from": "human", "value": ...}`` (LLaMA-Factory's tags, the
default) and ``{"role": "user", "content": ...}`` (OpenAI); the spec's ``columns`` and
``tags`` rename them, and a record without the configured turns column (``conversations``)
is read from ``messages`` when it has one. Roles: user, assistant, system, ``function_call``
(an assistant turn calling tools) and ``observation`` (the tool's answer, a ``tool`` turn);
see :mod:`prep.sources.formats.tools`. A first turn with the system tag is the system prompt,
replacing the ``system`` column, as in LLaMA-Factory's ``SharegptDatasetConverter``. Turn
contents are strings with ``<image>``/``<video>`` tags or content lists
(:mod:`prep.sources.formats.content`).

Example: ``{"conversations": [{"from": "human", "value": "<image>Describe."}, {"from":
"gpt", "value": "A cat."}], "images": ["a.jpg"]}`` -> messages ``[{"role": "user",
"content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}, {"role":
"assistant", "content": "A cat."}]``, media ``[image MEDIA_DIR/a.jpg]``.
"""

from __future__ import annotations

from typing import Any

from prep.sources.conversation import Conversation, Message
from prep.sources.errors import RecordError
from prep.sources.formats.base import register_format
from prep.sources.formats.content import MediaCursor, media_list
from prep.sources.formats.tools import assistant_tool_calls, function_call_message, parse_tools
from schemas.dataset_config import DatasetSpec
from schemas.reasons import Reason

KNOWN_ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "function_call",
}
OTHER_TURNS_COLUMN = {"conversations": "messages", "messages": "conversations"}


def to_conversation(record: object, spec: DatasetSpec) -> Conversation:
    """Validate a ShareGPT record and turn it into chat-template messages."""
    if not isinstance(record, dict):
        raise RecordError(Reason.BAD_RECORD, f"record must be a JSON object, got {type(record).__name__}")
    turns = _turns(record, spec)
    cursor = MediaCursor(
        spec=spec,
        images=media_list(record, spec.columns.images, spec, "image"),
        videos=media_list(record, spec.columns.videos, spec, "video"),
    )
    parsed = [_role(turn, spec) for turn in turns]
    messages: list[Message] = []
    system = record.get(spec.columns.system) if spec.columns.system else None
    if parsed[0][0] != "system" and isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    for role, content, turn in parsed:
        messages.append(_message(role, content, turn, cursor))
    cursor.check_all_used()
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(Reason.EMPTY_CONVERSATION, "no assistant turn: nothing to learn from")
    tools = parse_tools(record.get(spec.columns.tools)) if spec.columns.tools else None
    return Conversation(messages=messages, media=cursor.media, tools=tools)


def _turns(record: dict[str, Any], spec: DatasetSpec) -> list[Any]:
    column = spec.columns.messages
    turns = record.get(column)
    if turns is None and OTHER_TURNS_COLUMN.get(column) in record:
        column = OTHER_TURNS_COLUMN[column]
        turns = record[column]
    if not isinstance(turns, list) or not turns:
        raise RecordError(Reason.EMPTY_CONVERSATION, f"no turns in column {column!r}")
    if not all(isinstance(turn, dict) for turn in turns):
        raise RecordError(Reason.BAD_RECORD, "every turn must be a JSON object")
    return turns


def _role(turn: dict[str, Any], spec: DatasetSpec) -> tuple[str, object, dict[str, Any]]:
    """(role, raw content, turn); role one of user/assistant/system/tool/function_call."""
    tags = spec.tags
    role = turn.get(tags.role_tag, turn.get("role", turn.get("from")))
    content = turn.get(tags.content_tag, turn.get("content", turn.get("value")))
    mapping = {
        tags.user_tag: "user",
        tags.assistant_tag: "assistant",
        tags.system_tag: "system",
        tags.observation_tag: "tool",
        tags.function_tag: "function_call",
    }
    resolved = (mapping.get(role) or KNOWN_ROLES.get(role)) if isinstance(role, str) else None
    if resolved is None:
        raise RecordError(Reason.BAD_ROLE, f"unknown role {role!r}")
    return resolved, content, turn


def _message(role: str, content: object, turn: dict[str, Any], cursor: MediaCursor) -> Message:
    if role == "function_call":
        return function_call_message(content)
    if role == "assistant" and turn.get("tool_calls"):
        text = content if isinstance(content, str) else ""
        return assistant_tool_calls(turn, text)
    if role == "tool" and not isinstance(content, str):
        raise RecordError(Reason.BAD_RECORD, "content of an observation (tool) turn must be a string")
    if content is None:
        raise RecordError(Reason.BAD_RECORD, f"a {role} turn has no content")
    return {"role": role, "content": cursor.content(role, content)}


register_format("sharegpt", to_conversation)
