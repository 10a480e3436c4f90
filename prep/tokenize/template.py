"""Render a whole conversation with the model's chat template and derive the loss mask.

The conversation is rendered once and tokenized once: BPE merges across turn boundaries,
so per-turn tokenization would give other ids. The assistant spans come from the template
itself, for any model: turn i's span starts where ``render(messages[:i],
add_generation_prompt=True)`` ends and stops where ``render(messages[:i+1])`` ends. Both must
be prefixes of the full render (true for every template that renders history unchanged);
otherwise the sample is an error, not a guess. Tokens overlapping a span get mask 1, the same
overlap rule transformers uses for ``return_assistant_tokens_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from prep.tokenize.errors import SampleError
from schemas.reasons import Reason


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderedText:
    text: str
    assistant_spans: list[tuple[int, int]]  # character [start, end) of each assistant turn
    media_spans: tuple[tuple[int, int], ...] = ()  # text-level media expansions: never trained on


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # jinja raises many types (TemplateError, TypeError, raise_exception)
        raise SampleError(Reason.TEMPLATE_ERROR, f"chat template failed: {exc}") from exc


def render_with_spans(tokenizer: Any, template: str, messages: list[dict[str, Any]]) -> RenderedText:
    """Full render plus the character span of every assistant turn."""
    full = render(tokenizer, template, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_prefix(tokenizer, template, messages[:i], full, generation_prompt=True))
        end = len(_prefix(tokenizer, template, messages[: i + 1], full, generation_prompt=False))
        if end > start:
            spans.append((start, end))
    return RenderedText(text=full, assistant_spans=spans)


def _prefix(tokenizer: Any, template: str, head: list[dict[str, Any]], full: str, *, generation_prompt: bool) -> str:
    text = render(tokenizer, template, head, generation_prompt=generation_prompt) if head else ""
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
