"""Give a chat template its text turns in the form it renders: plain strings or content lists.

Readers emit plain-string content for turns without media (what Qwen, Gemma, GLM and Mistral
templates take). Some VLM templates only loop over content *items*: LLaVA-OneVision silently
drops a string reply, Idefics3 / SmolVLM render it empty, LLaVA-NeXT fails on it. Training on
such a render would learn nothing from the reply, without any error. So once per processor a
probe conversation is rendered both ways; when strings lose text that content lists keep,
every string turn is given as ``[{"type": "text", "text": ...}]`` — the form those templates
were written for — and the real processor sees the same messages, so ids stay exact.

Example: LLaVA-OneVision, ``{"role": "assistant", "content": "A cat."}`` renders as
``<|im_start|>assistant\\n<|im_end|>``; as a content list it renders ``...assistant\\nA cat.<|im_end|>``.
"""

from __future__ import annotations

from typing import Any

from packvlm.sample_error import SampleError
from prep.sources.conversation import Message
from prep.tokenize.template import render

_USER, _REPLY = "probe question zq", "probe answer zq"


def _keeps_text(tokenizer: Any, template: str, messages: list[Message]) -> bool:
    try:
        text = render(tokenizer, template, messages, generation_prompt=False)
    except SampleError:
        return False
    return _USER in text and _REPLY in text


def needs_content_lists(tokenizer: Any, template: str) -> bool:
    """True when the template loses string content that it renders from a content list."""
    strings = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}]
    if _keeps_text(tokenizer, template, strings):
        return False
    return _keeps_text(tokenizer, template, as_content_lists(strings))


def as_content_lists(messages: list[Message]) -> list[Message]:
    """Every plain-string ``content`` as a one-item text list; other content unchanged."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
        for m in messages
    ]
