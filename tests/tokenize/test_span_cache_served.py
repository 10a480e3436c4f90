"""The full text served from the shape cache (no ``apply_chat_template``) is exactly what it renders.

A shape's full render is served once a conversation of the shape rendered exactly it through
``apply_chat_template``; a render must depend on nothing but its inputs. Oracle: the uncached
span search (every render by ``apply_chat_template``). Checked here: a template printing
``strftime_now`` renders each conversation with the current date (the clock monkeypatched), one
drawing random values (jinja's ``random`` filter, ``lipsum``) is never served, an unknown
environment function aborts the symbolic render, a shape whose cached full render differs from
``apply_chat_template``'s is never served, conversations of one walked shape whose messages hold
a None-valued key at other places get their own sentinel renders, prefix-stable templates get
their spans as sums of lengths, and the shape of plain JSON messages taken without transformers'
walk equals the walked one (hypothesis).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import jinja2.filters
import jinja2.utils
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils import chat_template_utils

from families.processor import ProcessorBundle, load_processor
from families.registry import example_family
from packvlm.sample_error import SampleError
from prep.tokenize.span_cache import Unshaped, plain_text_slots, text_slots
from prep.tokenize.symbolic import Abort, SymbolicTemplate, Tracer
from prep.tokenize.template import ChatRenderer, render_with_spans

CHATML = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}<e>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
DATED = "Today is {{ strftime_now('%d %b %Y') }}.\n" + CHATML
RANDOM = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ ['a', 'b', 'c'] | random }}<e>{% endfor %}"
LIPSUM = "{{ lipsum(1, false, 1, 2) }}" + CHATML  # one word (two in a row would loop on a fixed draw)
# renders a message's keys in their order: a sentinel copy's content lands where the message had it
KEY_ORDER = (
    "{% for m in messages %}<{{ m.role }}>{% for k in m %}{% if k == 'content' %}{{ m.content }}"
    "{% elif k == 'name' %}({{ m.name }}){% endif %}{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    root: Path = tmp_path_factory.mktemp("served")
    return load_processor(str(example_family("qwen2_vl").build_processor(root / "qwen2_vl")))


def _oracle(tokenizer: Any, template: str) -> ChatRenderer:
    renderer = ChatRenderer(tokenizer, template, max_shapes=0)
    renderer.direct = False
    return renderer


def _result(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> tuple[Any, ...]:
    try:
        rendered = render_with_spans(renderer.tokenizer, renderer.template, messages, renderer=renderer)
    except SampleError as err:
        return ("error", err.reason, str(err))
    return ("ok", rendered.text, rendered.assistant_spans)


def _turns(question: str, reply: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Done."},
    ]


class _Clock:
    """Stands for ``datetime.datetime`` in transformers' ``strftime_now``: ``now()`` is what the test sets."""

    today = dt.datetime(2026, 11, 27)

    @classmethod
    def now(cls) -> dt.datetime:
        return cls.today


def test_a_template_printing_the_date_renders_each_conversation_with_today(bundle, monkeypatch):
    monkeypatch.setattr(chat_template_utils, "datetime", _Clock)
    cached, oracle = ChatRenderer(bundle.tokenizer, DATED), _oracle(bundle.tokenizer, DATED)
    for day, question in [(27, "Hi"), (27, "Hello"), (28, "Hey"), (29, "Yo")]:
        monkeypatch.setattr(_Clock, "today", dt.datetime(2026, 11, day))
        got = _result(cached, _turns(question, "Fine."))
        assert got == _result(oracle, _turns(question, "Fine."))
        assert f"Today is {day} Nov 2026." in got[1]
    assert cached.spans is not None
    assert (cached.spans.stats.hits, cached.spans.stats.full_served, cached.spans.stats.served) == (3, 0, 0)


@pytest.mark.parametrize("template", [RANDOM, LIPSUM], ids=["random", "lipsum"])
def test_a_template_drawing_random_values_is_never_served(bundle, monkeypatch, template):
    """Draws made deterministic (first choice, lowest range) so that a symbolic render that drew
    would equal the real one and be served: it must abort instead."""
    monkeypatch.setattr(jinja2.filters.random, "choice", lambda seq: seq[0])
    monkeypatch.setattr(jinja2.utils, "choice", lambda seq: seq[0])
    monkeypatch.setattr(jinja2.utils, "randrange", lambda start, stop=None: start)
    cached, oracle = ChatRenderer(bundle.tokenizer, template), _oracle(bundle.tokenizer, template)
    for question in ["Hi", "Hello", "Hey"]:
        assert _result(cached, _turns(question, "Fine.")) == _result(oracle, _turns(question, "Fine."))
    assert cached.spans is not None
    assert (cached.spans.stats.hits, cached.spans.stats.full_served, cached.spans.stats.served) == (2, 0, 0)


def test_an_environment_function_not_known_to_be_pure_aborts_the_symbolic_render():
    env = ImmutableSandboxedEnvironment()
    env.filters["shout"] = lambda text: "HEY"  # pure here, but nothing says so
    env.globals["now"] = lambda: "today"
    for template in ["{{ 'a' | shout }}{{ x }}", "{{ now() }}{{ x }}"]:
        symbolic = SymbolicTemplate(env.from_string(template), template)
        with pytest.raises(Abort):
            symbolic.render(Tracer([]), x="y")
    plain = "{{ 'a' | upper }}{{ range(2) | list | length }}{{ x }}"
    assert SymbolicTemplate(env.from_string(plain), plain).render(Tracer([]), x="y")[0] == ("A2y",)


class _Wrapped:
    """A tokenizer whose ``apply_chat_template`` adds to the text (a wrapper doing more than the template)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.special_tokens_map = tokenizer.special_tokens_map

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return "!" + self._tokenizer.apply_chat_template(*args, **kwargs)


def test_a_shape_whose_cached_full_render_differs_from_apply_chat_template_is_never_served(bundle):
    tokenizer = _Wrapped(bundle.tokenizer)
    cached, oracle = ChatRenderer(tokenizer, CHATML), _oracle(tokenizer, CHATML)
    for question in ["Hi", "Hello", "Hey"]:
        got = _result(cached, _turns(question, "Fine."))
        assert got == _result(oracle, _turns(question, "Fine."))
        assert got[0] == "ok" and got[1].startswith("!")
    assert cached.spans is not None
    assert (cached.spans.stats.hits, cached.spans.stats.full_served, cached.spans.stats.fallbacks) == (2, 0, 3)


def test_a_verified_shape_is_served_with_spans_as_sums_of_lengths(bundle):
    cached, oracle = ChatRenderer(bundle.tokenizer, CHATML), _oracle(bundle.tokenizer, CHATML)
    for question, reply in [("Hi", "Fine."), ("Hello there", "Good, thanks."), ("Hey", "Ok")]:
        assert _result(cached, _turns(question, reply)) == _result(oracle, _turns(question, reply))
    assert cached.spans is not None
    assert (cached.spans.stats.hits, cached.spans.stats.full_served, cached.spans.stats.fallbacks) == (2, 2, 0)
    (shape,) = cached.spans.shapes.values()
    assert [turn.index for turn in shape.plan.turns] == [1, 3]
    assert sorted(shape.points) == [(1, True, None), (2, False, None), (3, True, None), (4, False, None)]


def test_a_none_valued_key_s_place_keeps_its_sentinel_renders_apart(bundle):
    """The walk drops a None-valued key, so both conversations walk alike; the sentinel copy of the
    opening reply puts its content where the message had it, which this template renders."""
    cached, oracle = ChatRenderer(bundle.tokenizer, KEY_ORDER), _oracle(bundle.tokenizer, KEY_ORDER)
    first = [{"role": "assistant", "content": None, "name": "x"}, {"role": "user", "content": "Hi"}]
    second = [{"role": "assistant", "name": "x", "content": None}, {"role": "user", "content": "Hi"}]
    results = [_result(cached, messages) for messages in (first, second, first)]
    assert results == [_result(oracle, messages) for messages in (first, second, first)]
    assert results[0] != results[1], "the two must differ for the test to mean anything"


JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.sampled_from(["", "a", " b "])
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(["k", "text"]), inner, max_size=2),
    max_leaves=4,
)
TOOLS = st.one_of(st.none(), st.lists(st.dictionaries(st.sampled_from(["type", "name"]), JSON, max_size=2), max_size=2))
ITEM = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.sampled_from(["", "x"])}),
    st.fixed_dictionaries({"type": st.just("image")}),
    JSON,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"])},
    optional={
        "content": st.one_of(st.none(), st.sampled_from(["", "Hi"]), st.lists(ITEM, max_size=3), JSON),
        "reasoning_content": st.one_of(st.none(), st.sampled_from(["", "r"]), JSON),
        "thinking": st.one_of(st.none(), st.sampled_from(["t"])),
        "reasoning": st.one_of(st.none(), st.sampled_from(["q"])),
        "name": JSON,
    },
)


class _Str(str):
    """A str subclass: transformers' walk makes it a str; the shape without the walk must not take it."""


@given(
    messages=st.lists(MESSAGE, max_size=3),
    tools=st.one_of(
        st.none(), st.lists(st.dictionaries(st.sampled_from(["type", "name"]), JSON, max_size=2), max_size=2)
    ),
    odd=st.sampled_from([None, "tuple", "subclass"]),
)
@settings(max_examples=300, deadline=None, database=None)
def test_the_shape_of_plain_json_messages_is_the_walked_shape(bundle, messages, tools, odd):
    renderer = ChatRenderer(bundle.tokenizer, CHATML)
    if odd == "tuple" and messages:
        messages[0]["content"] = ("x", 1)
    elif odd == "subclass" and messages:
        messages[-1]["content"] = _Str("x")
    walked_tools = renderer.walk_tools(tools)[1]
    try:
        walked = text_slots(renderer.walk(messages), walked_tools, messages)
    except Unshaped:
        walked = None
    fast = plain_text_slots(messages, tools)
    assert fast is None or fast == walked
    if odd != "subclass":
        assert fast == walked
