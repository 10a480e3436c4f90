"""Render a whole conversation with the model's chat template and derive the loss mask.

The conversation is rendered once and tokenized once: BPE merges across turn boundaries,
so per-turn tokenization would give other ids. The assistant spans come from the template
itself, for any model: turn i's span starts where ``render(messages[:i],
add_generation_prompt=True)`` ends and stops where ``render(messages[:i+1])`` ends. Both must
be prefixes of the full render (true for every template that renders history unchanged);
otherwise the sample is an error, not a guess. Tokens overlapping a span get mask 1, the same
overlap rule transformers uses for ``return_assistant_tokens_mask``. Assistant turns that call
tools are trained on; ``tool`` turns (observations) are not. Tools reach the template as
``apply_chat_template(tools=...)`` takes them; a template that would silently drop them is a
``template_error`` row (:func:`check_tool_support`).
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

from prep.tokenize.errors import SampleError
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
        start = len(_prefix(tokenizer, template, messages[:i], full, True, tools))
        end = len(_prefix(tokenizer, template, messages[: i + 1], full, False, tools))
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


def _prefix(
    tokenizer: Any,
    template: str,
    head: list[dict[str, Any]],
    full: str,
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
) -> str:
    text = render(tokenizer, template, head, generation_prompt=generation_prompt, tools=tools) if head else ""
    if not full.startswith(text):
        raise SampleError(
            Reason.TEMPLATE_ERROR,
            f"chat template renders turn {len(head)} differently inside the full conversation; "
            "cannot derive an assistant mask from it",
        )
    return text


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
