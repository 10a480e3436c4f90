"""The shape cache of span renders gives exactly what rendering every span render does.

Oracle: today's span search with every render done by ``apply_chat_template`` (a
:class:`ChatRenderer` with no cache and the direct path off), independent of
:mod:`prep.tokenize.symbolic`. For every example family's real template and hand-written
templates that look into texts in the ways the cache must notice (only in prefix renders, after
capturing output, through ``~``, ``join``, ``in 'literal'``, ``int``), hypothesis draws conversation shapes
(system turn or not, turns, images in content lists, reasoning fields, tool calls where the
template reads them) and several text assignments per shape (edge whitespace, ``</think>``,
Gemma 4's channel markers, empty texts): text and spans, or the error, must be equal; the
repeats of a shape must hit the cache, and the cache must serve renders (the fast path runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from families.processor import ProcessorBundle, load_processor
from families.registry import example_families, example_family
from packvlm.sample_error import SampleError
from prep.tokenize.content_style import as_content_lists, needs_content_lists
from prep.tokenize.template import ChatRenderer, render_with_spans, template_tool_support

FAMILIES = example_families()
PIECES = ["Hi", "a cat", " ", "\n", "</think>", "<think>", "<channel|>", "<|channel>", "magic", "é", "x y", "  ", "42"]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city.", "parameters": {}}}]
CALL = [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]

# Templates that look into a text in ways a cache keyed by shape could miss.
PREFIX_ONLY = (  # the reply's text matters only where it is the last message: in prefix renders
    "{% for m in messages %}<{{ m.role }}>{% if loop.last and m.content == 'magic' %}!{% endif %}"
    "{{ m.content }}<end>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
CAPTURED = (  # output captured, then inspected
    "{% for m in messages %}{% set c %}{{ m.content }}{% endset %}<{{ m.role }}>"
    "{{ c | trim }}{% if '</think>' in c %}T{% endif %}<end>{% endfor %}"
)
JOINED = "{% for m in messages %}{% set c = m.role ~ ':' ~ m.content %}{{ c }}{{ [c] | join }}<e>{% endfor %}"
IN_LITERAL = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content in 'Hi there' %}?{% endif %}{{ m.content }}<e>{% endfor %}"
)
MACRO = (
    "{% macro body(m) %}{{ m.content.split('</think>')[-1] | trim }}{% endmacro %}"
    "{% for m in messages %}<{{ m.role }}>{{ body(m) }}{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
    "{% endif %}<e>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
LENGTH = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ m.content | length }}<e>{% endfor %}"
# jinja's int filter catches TypeError: a text must not take the fallback a str would not
NUMERIC = "{% for m in messages %}<{{ m.role }}>{{ m.content }}={{ m.content | int }}<e>{% endfor %}"
HAND_WRITTEN = {
    "numeric": NUMERIC,
    "prefix_only": PREFIX_ONLY,
    "captured": CAPTURED,
    "joined": JOINED,
    "in_literal": IN_LITERAL,
    "macro": MACRO,
    "length": LENGTH,
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ProcessorBundle]:
    root: Path = tmp_path_factory.mktemp("span_cache")
    return {name: load_processor(str(example_family(name).build_processor(root / name))) for name in FAMILIES}


def _oracle(tokenizer: Any, template: str) -> ChatRenderer:
    """Today's span search, every render by ``apply_chat_template``."""
    renderer = ChatRenderer(tokenizer, template, max_shapes=0)
    renderer.direct = False
    return renderer


def _result(renderer: ChatRenderer, messages: list[dict[str, Any]], tools: Any) -> tuple[Any, ...]:
    try:
        rendered = render_with_spans(renderer.tokenizer, renderer.template, messages, tools, renderer=renderer)
    except SampleError as err:
        return ("error", err.reason, str(err))
    return ("ok", rendered.text, rendered.assistant_spans)


@st.composite
def shapes(draw: st.DrawFn, tools_ok: bool) -> tuple[list[dict[str, Any]], bool]:
    """Messages with ``None`` where a text goes, and whether tools are passed."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": None})
    use_tools = tools_ok and draw(st.booleans())
    for turn in range(draw(st.integers(1, 3))):
        images = draw(st.integers(0, 2))
        if images or draw(st.booleans()):
            items: list[dict[str, Any]] = [{"type": "image"}] * images
            items.insert(draw(st.integers(0, images)), {"type": "text", "text": None})
            messages.append({"role": "user", "content": items})
        else:
            messages.append({"role": "user", "content": None})
        if use_tools and turn == 0:
            messages.append({"role": "assistant", "content": None, "tool_calls": CALL})
            messages.append({"role": "tool", "content": None})
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        if draw(st.booleans()):
            reply["reasoning_content"] = None
        messages.append(reply)
    return messages, use_tools


def _slots(messages: list[dict[str, Any]]) -> int:
    return sum(
        1 if v is None else sum(1 for item in v if item.get("type") == "text") if isinstance(v, list) else 0
        for m in messages
        for k, v in m.items()
        if k in ("content", "reasoning_content")
    )


def _filled(messages: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
    """The shape with its text slots filled in order."""
    it = iter(texts)
    out = []
    for m in messages:
        filled = dict(m)
        for key in ("content", "reasoning_content"):
            value = m.get(key, 0)
            if value is None:
                filled[key] = next(it)
            elif isinstance(value, list):
                filled[key] = [{**i, "text": next(it)} if i.get("type") == "text" else i for i in value]
        out.append(filled)
    return out


@st.composite
def cases(draw: st.DrawFn, tools_ok: bool) -> tuple[list[list[dict[str, Any]]], bool]:
    """One shape and three conversations of it (same empty slots, other texts)."""
    messages, use_tools = draw(shapes(tools_ok))
    empty = [draw(st.booleans()) and draw(st.booleans()) for _ in range(_slots(messages))]
    text = st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join)
    conversations = []
    for _ in range(3):
        texts = [draw(text) if not e else "" for e in empty]
        conversations.append(_filled(messages, texts))
    return conversations, use_tools


def _check_against_oracle(tokenizer: Any, template: str, content_lists: bool) -> ChatRenderer:
    """Hypothesis cases through the cached renderer and the oracle; returns the cached renderer."""
    cached = ChatRenderer(tokenizer, template)
    oracle = _oracle(tokenizer, template)
    tools_ok = {"tools", "tool_calls", "tool"} <= template_tool_support(template)
    shapes_seen: list[int] = []

    @given(cases(tools_ok))
    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: tuple[list[list[dict[str, Any]]], bool]) -> None:
        conversations, use_tools = case
        assert cached.spans is not None
        hits, rendered = cached.spans.stats.hits, 0
        for messages in conversations:
            messages = as_content_lists(messages) if content_lists else messages
            tools = TOOLS if use_tools else None
            want = _result(oracle, messages, tools)
            assert _result(cached, messages, tools) == want
            rendered += want[0] == "ok" or "cannot derive an assistant mask" in want[2]  # the full render ran
        shapes_seen.append(rendered)
        assert cached.spans.stats.hits - hits >= rendered - 1  # every repeat of the shape hit it

    run()
    assert sum(shapes_seen) > 0
    return cached


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_template_cached_equals_rendering_every_span(bundles, family):
    bundle = bundles[family]
    content_lists = needs_content_lists(bundle.tokenizer, bundle.chat_template)
    cached = _check_against_oracle(bundle.tokenizer, bundle.chat_template, content_lists)
    assert cached.spans is not None and cached.spans.stats.served > 0  # the cache did serve span renders
    assert cached.spans.stats.full_served > 0  # ... and full texts, apply_chat_template skipped


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_templates_that_look_into_texts_cached_equals_rendering_every_span(bundles, name):
    _check_against_oracle(bundles["qwen2_vl"].tokenizer, HAND_WRITTEN[name], content_lists=False)


TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "How?"},
    {"role": "assistant", "content": "Fine."},
]


def test_a_text_checked_only_in_prefix_renders_is_not_served_from_the_cache(bundles):
    """'magic' as the first reply changes its prefix render only: the cache must not serve that render."""
    tokenizer = bundles["qwen2_vl"].tokenizer
    cached, oracle = ChatRenderer(tokenizer, PREFIX_ONLY), _oracle(tokenizer, PREFIX_ONLY)
    magic = [dict(m) for m in TURNS]
    magic[1]["content"] = "magic"
    for messages in (TURNS, magic):
        assert _result(cached, messages, None) == _result(oracle, messages, None)
    assert cached.spans is not None and cached.spans.stats.hits == 1


@pytest.mark.parametrize(
    ("family", "reply", "served"),
    [
        ("gemma4", "Fine.", True),
        ("gemma4", " Fine. ", False),  # Gemma 4 trims replies: the cached renders do not hold
        ("gemma4", "Fine.<|channel>thought<channel|>", False),  # ... and strips thinking
        ("glm46v", "Fine.", True),
        ("glm46v", "Hmm</think>Fine.", False),  # GLM-4.6V splits reasoning off at </think>
        ("kimi_k25", "Fine.", True),
        ("kimi_k25", " Fine. ", True),  # Kimi K2.5 renders texts as they are
    ],
)
def test_texts_the_template_rewrites_render_for_real(bundles, family, reply, served):
    """Same shape, other reply: served from the cache where the template renders it as given, else rendered."""
    bundle = bundles[family]
    cached = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    oracle = _oracle(bundle.tokenizer, bundle.chat_template)
    second = [dict(m) for m in TURNS]
    second[3]["content"] = reply
    assert _result(cached, TURNS, None) == _result(oracle, TURNS, None)
    assert cached.spans is not None
    before = (cached.spans.stats.hits, cached.spans.stats.served, cached.spans.stats.fallbacks)
    assert _result(cached, second, None) == _result(oracle, second, None)
    after = (cached.spans.stats.hits, cached.spans.stats.served, cached.spans.stats.fallbacks)
    assert after[0] == before[0] + 1  # the same shape
    assert (after[1] > before[1], after[2] > before[2]) == (served, not served)


def test_items_the_template_joins_are_served_from_the_cache(bundles):
    """MiniCPM-V 4.6's template joins a message's items with ``| join('\\n')``: the joined texts stay
    symbolic, so a second conversation of that shape is served (and equals the oracle)."""
    bundle = bundles["minicpmv4_6"]
    cached = ChatRenderer(bundle.tokenizer, bundle.chat_template)
    oracle = _oracle(bundle.tokenizer, bundle.chat_template)

    def conversation(question: str, reply: str) -> list[dict[str, Any]]:
        items = [{"type": "image"}, {"type": "text", "text": question}, {"type": "text", "text": "Be brief."}]
        return [{"role": "user", "content": items}, {"role": "assistant", "content": reply}]

    for messages in (conversation("What is it?", "A cat."), conversation("And this one?", "A dog.")):
        assert _result(cached, messages, None) == _result(oracle, messages, None)
    assert cached.spans is not None
    assert (cached.spans.stats.hits, cached.spans.stats.fallbacks) == (1, 0)
    assert cached.spans.stats.served > 0


class _Owner:
    """Stands for the worker's tokenizer: referenced only from the frame that renders."""


def _render_from(owner: _Owner, renderer: ChatRenderer, messages: list[dict[str, Any]]) -> None:
    assert owner is not None  # the frame holds ``owner`` while the render runs
    render_with_spans(renderer.tokenizer, renderer.template, messages, renderer=renderer)


def test_an_aborted_symbolic_render_keeps_no_caller_alive(bundles):
    """A symbolic render that aborts (``| int`` on a text) must not leave a reference cycle through
    the frames of its callers: `prep tokenize` in one process then kept the worker's tokenizer and
    its LMDB environment open until the cyclic collector ran, and `prep pack` failed opening it."""
    import gc
    import weakref

    tokenizer = bundles["qwen2_vl"].tokenizer
    renderer = ChatRenderer(tokenizer, NUMERIC)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "7"}]
    owner = _Owner()
    alive = weakref.ref(owner)
    gc.disable()
    try:
        _render_from(owner, renderer, messages)
        assert renderer.spans is not None and renderer.spans.stats.misses == 1
        del owner
        assert alive() is None, "a reference cycle from the aborted render holds the caller's frame"
    finally:
        gc.enable()
