"""Render a whole conversation with the model's chat template and derive the loss mask.

The conversation is rendered once and tokenized once: BPE merges across turn boundaries,
so per-turn tokenization would give other ids. The assistant spans come from the template
itself, for any model. Where the template renders history unchanged, turn i's span starts
where ``render(messages[:i], add_generation_prompt=True)`` ends and stops where
``render(messages[:i+1])`` ends, both prefixes of the full render. Templates that rewrite
earlier turns depending on where the conversation stops are not prefix-stable: Mistral's
(pixtral-12b) puts the system prompt into the *last* user turn only, GLM-4.6V keeps the
reasoning of the last reply only. For such a turn the reply is located by rendering the whole
conversation once more with that reply's text swapped for a sentinel (the text that differs is
the reply as rendered inside the conversation) and the conversation ending at the sentinel
reply (what follows the sentinel is the turn's end-of-turn marker, trained on like the reply).
A reply that opens the conversation has no generation prompt to end at: it is located the same
way and starts at its text (not at character 0, which would train on a default system prompt).
Only a template that still renders the rest differently is an error, naming why; never a guess.
Tokens overlapping a span get mask 1, the same overlap rule transformers uses for
``return_assistant_tokens_mask``. Assistant turns that call tools are trained on; ``tool``
turns (observations) are not. Tools reach the template as ``apply_chat_template(tools=...)``
takes them; a template that would silently drop them is a ``template_error`` row
(:func:`check_tool_support`).

Example (pixtral-12b, ``[system, user "Hi", assistant "Hello."]``): the full render is
``<s>[INST]Hi[/INST]Hello.</s>`` (the template drops a system prompt unless a user turn is
last, as the real processor does), the generation prompt ``<s>[INST]<system>\\n\\nHi[/INST]``
is no prefix of it, so the sentinel renders give the span ``Hello.</s>``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jinja2.meta
import numpy as np
import numpy.typing as npt
from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from packvlm.sample_error import SampleError
from schemas.reasons import Reason


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderedText:
    text: str
    assistant_spans: list[tuple[int, int]]  # character [start, end) of each assistant turn
    media_spans: tuple[tuple[int, int], ...] = ()  # text-level media expansions: never trained on


def render(
    tokenizer: Any,
    template: str,
    messages: list[dict[str, Any]],
    *,
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``apply_chat_template`` text; ``tools`` passed as transformers takes them (JSON schemas)."""
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt, tools=tools
        )
    except Exception as exc:  # jinja raises many types (TemplateError, TypeError, raise_exception)
        raise SampleError(Reason.TEMPLATE_ERROR, f"chat template failed: {exc}") from exc


def render_with_spans(
    tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> RenderedText:
    """Full render plus the character span of every assistant turn (tool calls included)."""
    check_tool_support(template, messages, tools)
    full = render(tokenizer, template, messages, generation_prompt=False, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _turn_span(tokenizer, template, messages, i, full, tools)
        if end > start:
            spans.append((start, end))
    return RenderedText(text=full, assistant_spans=spans)


@functools.lru_cache(maxsize=16)
def template_tool_support(template: str) -> frozenset[str]:
    """What of tool use a template reads: ``tools``, ``tool_calls``, the ``tool`` role.

    Parsed the way transformers parses templates (``utils/chat_template_utils.py``,
    ``_get_template_variables``: ``_compile_jinja_template(...).environment.parse`` then
    ``jinja2.meta.find_undeclared_variables``). A template that never reads them renders a
    conversation with tools without error and without the tools: a silent loss we refuse.
    """
    ast = _compile_jinja_template(template).environment.parse(template)
    found = {"tools"} & jinja2.meta.find_undeclared_variables(ast)
    attrs = {n.attr for n in ast.find_all(nodes.Getattr)}
    consts = {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    if "tool_calls" in attrs | consts:
        found.add("tool_calls")
    if "tool" in consts:
        found.add("tool")
    return frozenset(found)


def check_tool_support(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    """Raise a template error naming what of the conversation's tool use the template would drop."""
    needed = {
        "tools": bool(tools),
        "tool_calls": any(m.get("tool_calls") for m in messages),
        "tool": any(m["role"] == "tool" for m in messages),
    }
    missing = sorted(k for k, used in needed.items() if used and k not in template_tool_support(template))
    if missing:
        what = {"tools": "the tools list", "tool_calls": "assistant tool calls", "tool": "tool results (role 'tool')"}
        raise SampleError(
            Reason.TEMPLATE_ERROR,
            "the chat template cannot render tool use: it never reads "
            + ", ".join(what[k] for k in missing)
            + ", so they would be dropped silently; use a processor whose chat template supports tools "
            "(e.g. Qwen2.5 / Qwen3 templates) or remove the tools and function_call/observation turns",
        )


# Stands in for one reply's text; no real conversation holds it (checked: it must occur exactly once).
SENTINEL = "PACKVLM_REPLY_SENTINEL_7F3A"


def _turn_span(
    tokenizer: Any,
    template: str,
    messages: list[dict[str, Any]],
    i: int,
    full: str,
    tools: list[dict[str, Any]] | None,
) -> tuple[int, int]:
    """Character span of assistant turn ``i`` in ``full``: by prefixes (2 renders), else by sentinel (2 more)."""
    if i == 0:  # no generation prompt to end at: the reply starts where its text does
        return _sentinel_span(tokenizer, template, messages, i, full, None, tools)
    head = render(tokenizer, template, messages[:i], generation_prompt=True, tools=tools)
    if full.startswith(head):
        turn = render(tokenizer, template, messages[: i + 1], generation_prompt=False, tools=tools)
        if full.startswith(turn) and len(turn) >= len(head):
            return len(head), len(turn)
    return _sentinel_span(tokenizer, template, messages, i, full, head, tools)


def _sentinel_span(
    tokenizer: Any,
    template: str,
    messages: list[dict[str, Any]],
    i: int,
    full: str,
    head: str | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[int, int]:
    """Turn ``i``'s span in a template that rewrites other turns depending on where the conversation ends.

    ``full`` with reply ``i`` swapped for :data:`SENTINEL` gives the reply's rendered text (what
    differs); the conversation ending at the sentinel reply gives the end-of-turn marker (after
    the sentinel) and the assistant header after the generation prompt ``head`` (before it).
    """
    swapped = [*messages[:i], _with_sentinel(messages[i]), *messages[i + 1 :]]
    whole = render(tokenizer, template, swapped, generation_prompt=False, tools=tools)
    ending = render(tokenizer, template, swapped[: i + 1], generation_prompt=False, tools=tools)
    if whole.count(SENTINEL) != 1 or ending.count(SENTINEL) != 1:
        raise _span_error(i, "it does not render the reply's text exactly once, as given")
    before, after = whole.split(SENTINEL)
    if not (full.startswith(before) and full.endswith(after) and len(before) + len(after) <= len(full)):
        raise _span_error(i, "changing this reply's text changes how it renders the other turns")
    reply_start, reply_end = len(before), len(full) - len(after)
    header, closing = ending.split(SENTINEL)
    if not full.startswith(closing, reply_end):
        raise _span_error(i, f"the reply ends with {closing!r} when the conversation ends there, but not inside it")
    start = reply_start
    if head is not None and header.startswith(head) and full[:reply_start].endswith(header[len(head) :]):
        start -= len(header) - len(head)  # the assistant header after the generation prompt, as the prefix rule
    return start, reply_end + len(closing)


def _with_sentinel(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its text replaced by the sentinel, in the content form it had (tool calls kept)."""
    content = message.get("content")
    text: Any = SENTINEL if content is None or isinstance(content, str) else [{"type": "text", "text": SENTINEL}]
    return {**message, "content": text}


def _span_error(i: int, why: str) -> SampleError:
    return SampleError(
        Reason.TEMPLATE_ERROR,
        f"chat template renders turn {i} (assistant) differently inside the full conversation than when the "
        f"conversation ends there, and {why}; cannot derive an assistant mask from it",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedText:
    input_ids: list[int]
    loss_mask: npt.NDArray[np.uint8]  # same length


def tokenize_rendered(tokenizer: Any, rendered: RenderedText) -> TokenizedText:
    """Tokenize as the processor does (no second BOS when the template already starts with it)."""
    bos = tokenizer.bos_token
    add_special = not (bos is not None and rendered.text.startswith(bos))
    enc = tokenizer(rendered.text, add_special_tokens=add_special, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for start, end in rendered.assistant_spans:
        mask |= ((offsets[:, 0] < end) & (offsets[:, 1] > start)).astype(np.uint8)
    for start, end in rendered.media_spans:
        mask[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 0
    return TokenizedText(input_ids=list(enc["input_ids"]), loss_mask=mask)
