"""Tool use in records -> what transformers' ``apply_chat_template`` takes.

LLaMA-Factory stores a row's tool definitions as a JSON string (``tools`` column) and a
call as a ``function_call`` turn whose value is JSON ``{"name": ..., "arguments": ...}`` (or
a list of them, for parallel calls); the tool's answer is an ``observation`` turn. Hugging
Face chat templates take ``tools=[{"type": "function", "function": {...}}, ...]``, the call
as an assistant message with ``tool_calls`` and the answer as a ``tool`` message, e.g.
Qwen2.5/Qwen3 templates render ``<tool_call>`` inside the assistant turn and
``<tool_response>`` inside a user turn. So::

    {"from": "function_call", "value": "{\"name\": \"f\", \"arguments\": {\"x\": 1}}"}
    -> {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}

Bare function definitions are wrapped the way LLaMA-Factory's ``QwenToolUtils.tool_formatter``
(``src/llamafactory/data/tool_utils.py``) does: ``tool if tool.get("type") == "function" else
{"type": "function", "function": tool}``; arguments are kept as given (LLaMA-Factory's
``FunctionFormatter`` also passes them through).
"""

from __future__ import annotations

import json
from typing import Any

from prep.sources.errors import RecordError
from schemas.reasons import Reason

Tool = dict[str, Any]


def _as_list(value: object, what: str) -> object:
    """LLaMA-Factory stores tools and calls as JSON text: parse it; one object is a list of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RecordError(Reason.BAD_RECORD, f"{what} is not valid JSON: {exc}") from exc
    return [value] if isinstance(value, dict) else value


def parse_tools(value: object) -> list[Tool] | None:
    """The ``tools`` column: a JSON string, a list or one object; empty means no tools."""
    if value is None or value == "" or value == []:
        return None
    value = _as_list(value, "tools column")
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RecordError(Reason.BAD_RECORD, "tools must be a list of function definitions (JSON objects)")
    return [t if t.get("type") == "function" else {"type": "function", "function": t} for t in value] or None


def function_call_message(content: object) -> dict[str, Any]:
    """A ``function_call`` turn as an assistant message carrying ``tool_calls``."""
    calls = _as_list(content, "function_call turn")
    if not isinstance(calls, list) or not calls:
        raise RecordError(Reason.BAD_RECORD, "function_call turn must hold a call or a list of calls")
    return {"role": "assistant", "content": "", "tool_calls": [_tool_call(c) for c in calls]}


def assistant_tool_calls(message: dict[str, Any], content: str) -> dict[str, Any]:
    """An OpenAI-style assistant turn that already carries ``tool_calls``."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise RecordError(Reason.BAD_RECORD, "tool_calls must be a non-empty list")
    return {"role": "assistant", "content": content, "tool_calls": [_tool_call(c) for c in calls]}


def _tool_call(call: object) -> dict[str, Any]:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise RecordError(Reason.BAD_RECORD, f"a tool call needs 'name' and 'arguments', got {call!r:.80}")
    return {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
