"""The span renders of :class:`ChatRenderer` equal ``apply_chat_template``'s, render for render.

The renderer walks a conversation's messages once and renders the compiled template directly
for the prefixes and sentinel copies the spans need. The oracle is transformers'
``apply_chat_template`` called on the same messages (:func:`render`), for every example
family's template: each prefix with and without the generation prompt, each reply swapped for
the sentinel, with a system turn, content lists, tool calls, reasoning fields and None-valued
keys. A renderer is reused across conversations, so a second conversation that differs only in
its system prompt, its media count or one reply must give its own renders, not the first's.
"""

from __future__ import annotations

from typing import Any

import pytest

from families.processor import ProcessorBundle, load_processor
from families.registry import example_families, example_family
from packvlm.sample_error import SampleError
from prep.tokenize.content_style import as_content_lists, needs_content_lists
from prep.tokenize.template import SENTINEL, ChatRenderer, _with_sentinel, render, render_with_spans

FAMILIES = example_families()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ProcessorBundle]:
    root = tmp_path_factory.mktemp("renderer")
    return {name: load_processor(str(example_family(name).build_processor(root / name))) for name in FAMILIES}


def _conversation(bundle: ProcessorBundle, system: str, images: int, reply: str) -> list[dict[str, Any]]:
    """System, an image turn, two replies (the first with reasoning and a None key), content lists where needed."""
    content: Any = [*([{"type": "image"}] * images), {"type": "text", "text": "What is it?"}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": content},
        {"role": "assistant", "content": reply, "reasoning_content": "Look first.", "name": None},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    if needs_content_lists(bundle.tokenizer, bundle.chat_template):
        messages = as_content_lists(messages)
    return messages


def _official(bundle: ProcessorBundle, messages: list[dict[str, Any]], end: int, gp: bool, sentinel: int | None) -> str:
    """apply_chat_template on the messages as the span search means them: the oracle."""
    picked = list(messages[:end])
    if sentinel is not None:
        picked[sentinel] = _with_sentinel(picked[sentinel])
    return render(bundle.tokenizer, bundle.chat_template, picked, generation_prompt=gp)


def _official_or_error(
    bundle: ProcessorBundle, messages: list[dict[str, Any]], end: int, gp: bool, sentinel: int | None
) -> str | None:
    """The oracle's text; None where the template raises on that prefix (MiniCPM-V 4.6's without a user turn)."""
    try:
        return _official(bundle, messages, end, gp, sentinel)
    except SampleError:
        return None


def _text_or_error(conv: Any, end: int, gp: bool, sentinel: int | None) -> str | None:
    try:
        return str(conv.text(end, generation_prompt=gp, sentinel=sentinel))
    except SampleError:
        return None


def _all_renders_equal(bundle: ProcessorBundle, renderer: ChatRenderer, messages: list[dict[str, Any]]) -> None:
    conv = renderer.conversation(messages, None)
    assert conv.full == _official(bundle, messages, len(messages), False, None)
    for end in range(1, len(messages) + 1):
        for gp in (False, True):
            assert _text_or_error(conv, end, gp, None) == _official_or_error(bundle, messages, end, gp, None), (end, gp)
        for i in range(end):
            if messages[i]["role"] == "assistant":
                got = _text_or_error(conv, end, False, i)
                official = _official_or_error(bundle, messages, end, False, i)
                assert got == official, (end, i)
                assert got is None or SENTINEL in got or SENTINEL not in (official or "")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_span_render_equals_apply_chat_template(bundles, family):
    bundle = bundles[family]
    renderer = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    messages = _conversation(bundle, "You are careful.", 1, "A cat.")
    assert renderer.conversation(messages, None).direct, "the direct path must be the one under test"
    _all_renders_equal(bundle, renderer, messages)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma4", "glm46v", "pixtral", "kimi_k25"])
def test_a_reused_renderer_gives_each_conversation_its_own_renders(bundles, family):
    """Same renderer, conversations differing in system prompt, media count, one reply: fresh results each.

    (Pixtral writes the system prompt into the last user turn only: the generation-prompt render shows it.)
    """
    bundle = bundles[family]
    renderer = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    variants = [
        _conversation(bundle, "You are careful.", 1, "A cat."),
        _conversation(bundle, "You are brief.", 1, "A cat."),
        _conversation(bundle, "You are careful.", 2, "A cat."),
        _conversation(bundle, "You are careful.", 1, "A dog."),
    ]
    texts = []
    for messages in variants:
        _all_renders_equal(bundle, renderer, messages)
        shared = render_with_spans(bundle.tokenizer, bundle.chat_template, messages, renderer=renderer)
        alone = render_with_spans(bundle.tokenizer, bundle.chat_template, messages)
        assert shared == alone
        texts.append((shared.text, renderer.conversation(messages, None).text(4, generation_prompt=True)))
    assert len(set(texts)) == len(variants), "the variants must render differently for the test to mean anything"


def test_tools_render_as_apply_chat_template_takes_them(bundles):
    bundle = bundles["qwen2_vl"]
    tools = [{"type": "function", "function": {"name": "zoom", "description": "Zoom in.", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Zoom."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {}}}],
        },
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "Zoomed."},
    ]
    conv = ChatRenderer(bundle.tokenizer, bundle.chat_template).conversation(messages, tools)
    assert conv.direct
    for end in range(1, len(messages) + 1):
        want = render(bundle.tokenizer, bundle.chat_template, messages[:end], generation_prompt=True, tools=tools)
        assert conv.text(end, generation_prompt=True) == want


def test_a_direct_render_that_differs_falls_back_to_apply_chat_template(bundles):
    """A wrapper that passes other variables (here: another bos_token) is caught on the full text."""
    bundle = bundles["gemma3"]  # its template writes bos_token
    renderer = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    renderer.variables = {**renderer.variables, "bos_token": "<wrong>"}
    messages = _conversation(bundle, "You are careful.", 1, "A cat.")
    conv = renderer.conversation(messages, None)
    assert not conv.direct
    _all_renders_equal(bundle, renderer, messages)
    fresh = render_with_spans(bundle.tokenizer, bundle.chat_template, messages)
    assert render_with_spans(bundle.tokenizer, bundle.chat_template, messages, renderer=renderer) == fresh


def test_a_direct_render_that_raises_gives_apply_chat_template_s_text(bundles):
    """Where the direct path fails (here: a clashing variable), apply_chat_template renders instead."""
    bundle = bundles["qwen2_vl"]
    renderer = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    renderer.variables = {**renderer.variables, "documents": None}  # render() gets documents twice: TypeError
    messages = _conversation(bundle, "You are careful.", 1, "A cat.")
    conv = renderer.conversation(messages, None)
    assert not conv.direct
    _all_renders_equal(bundle, renderer, messages)
