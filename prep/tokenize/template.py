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
Qwen3.5's template (MiniCPM-V 4.6's) moves a last reply's inline ``<think>...</think>`` into a
block of its own, so the sentinel copy renders differently around it: such a reply is located
where the two renders differ by exactly its reasoning and answer, and starts at the reasoning.
Only a template that still renders the rest differently is an error, naming why; never a guess.
The renders after the full one are done once per conversation shape with the texts symbolic and
served to each conversation of that shape whose texts provably render the same way
(:mod:`prep.tokenize.span_cache`): one template render per sample instead of up to seven.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jinja2.meta
from jinja2 import nodes
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import _compile_jinja_template

from packvlm.errors import InternalError
from packvlm.sample_error import SampleError
from prep.tokenize.span_cache import (
    RenderKey,
    ShapeRenders,
    SpanCache,
    Unshaped,
    plain_text_slots,
    text_slots,
)
from prep.tokenize.span_plan import span_plan
from prep.tokenize.symbolic import SymbolicTemplate, materialize
from schemas.reasons import Reason

Message = dict[str, Any]
Span = tuple[int, int]


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
    tokenizer: Any,
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    renderer: ChatRenderer | None = None,
) -> RenderedText:
    """Full render plus the character span of every assistant turn (tool calls included).

    ``renderer``: the worker's :class:`ChatRenderer` for this tokenizer and template (built here if not given).
    """
    check_tool_support(template, messages, tools)
    renderer = renderer or ChatRenderer(tokenizer, template)
    return renderer.render_with_spans(messages, tools)


def _spans(roles: Iterable[Any], planned: dict[int, Span], unplanned: Callable[[int], Span]) -> list[Span]:
    """Each assistant turn's span, empty ones left out: ``planned`` (those a :class:`SpanPlan` gave),
    else ``unplanned(i)`` (from the renders, built only when a turn asks: a cached sample whose turns
    are all planned builds no :class:`ConversationRenders`)."""
    spans = []
    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        start, end = planned[i] if i in planned else unplanned(i)
        if end > start:
            spans.append((start, end))
    return spans


def _roles(messages: Any) -> list[Any] | None:
    """Each message's role; None where one has none (the uncached path raises what it raised before)."""
    try:
        return [message["role"] for message in messages]
    except Exception:
        return None


# transformers' own per-call input walk (5.2x): objects to dicts and None keys dropped, plain JSON
# types, reasoning fields aliased. Each maps the messages one by one. Absent (another version): every
# render goes through apply_chat_template.
_NORMALIZE = getattr(chat_template_utils, "_normalize_chat_messages", None)
_PLAIN = getattr(chat_template_utils, "_plain_template_data", None)
_ALIAS = getattr(chat_template_utils, "_alias_reasoning_fields", None)


class ChatRenderer:
    """Renders as ``apply_chat_template`` does, for the 1-7 renders one conversation's spans take.

    ``apply_chat_template`` walks its input on every call (objects to dicts, None keys dropped,
    plain JSON types, reasoning fields aliased); for a short conversation that walk costs several
    times the render itself. Span finding renders prefixes and sentinel copies of one
    conversation, so the messages are walked once with transformers' own helpers (each maps
    message by message: a prefix of the walked list is the walked prefix) and the compiled template
    renders them directly with the variables ``apply_chat_template`` passes (the named special
    tokens, ``documents=None``). Where the direct render of the whole conversation differs from
    ``apply_chat_template``'s (a transformers version whose wrapper does more), every render of that
    conversation goes through ``apply_chat_template``, and so does any render the direct path raises on.

    Conversations of one shape share their renders but for the texts (:mod:`prep.tokenize.span_cache`):
    one whose texts pass its shape's checks takes the full text and the spans from there, the spans
    as sums of lengths where its prefix renders are prefixes piece by piece (:mod:`prep.tokenize.span_plan`),
    without rendering at all. The full text is ``apply_chat_template``'s for the first ``verify``
    conversations of a shape whose checks hold; a shape whose cached full render differed from it
    even once is never served again. One per worker: it holds the compiled template and the shape
    cache, nothing per sample.
    """

    def __init__(self, tokenizer: Any, template: str, *, max_shapes: int = 1024, verify: int = 1) -> None:
        """``max_shapes``: conversation shapes whose renders are kept (0: none, every render done);
        ``verify``: conversations per shape whose full text ``apply_chat_template`` renders and the cache must equal."""
        self.tokenizer = tokenizer
        self.template = template
        self.verify = verify
        self.direct = _NORMALIZE is not None and _PLAIN is not None and _ALIAS is not None
        self.compiled = _compile_jinja_template(template) if self.direct else None
        self.variables: dict[str, Any] = _PLAIN(dict(tokenizer.special_tokens_map)) if _PLAIN is not None else {}
        cached = self.compiled is not None and max_shapes > 0
        self.spans = SpanCache(SymbolicTemplate(self.compiled, template), max_shapes) if cached else None

    def render_with_spans(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> RenderedText:
        """The full text and assistant spans, from the shape cache where it proves them (see the class)."""
        spans = self.spans if self.direct else None
        roles = _roles(messages) if spans is not None else None
        walked: tuple[list[Message], Any] | None = None
        slots = plain_text_slots(messages, tools) if spans is not None and roles is not None else None
        if spans is not None and roles is not None and slots is None:  # not plain JSON: shaped after the walk
            walked = self._walked(messages, tools)
            try:
                slots = None if walked is None else text_slots(walked[0], walked[1], messages)
            except Unshaped:
                pass
        if spans is None or roles is None or slots is None:  # (no role: the loop after the full render raises)
            return self._rendered(messages, tools, self._full(messages, tools), walked)
        key, texts = slots

        def build() -> ShapeRenders:
            built = walked or self._walked(messages, tools)
            if built is None:
                raise InternalError("transformers' chat input walk raised on plain JSON messages")
            return ShapeRenders(spans.symbolic, self.variables, built[0], built[1], texts)

        shape = spans.renders(key, build)
        sentinel_copy = functools.partial(self._sentinel_copy, messages)
        point = None if shape.broken else shape.point((len(messages), False, None), sentinel_copy)
        plan = None if point is None else span_plan(shape, point, roles, sentinel_copy)
        covered = plan is not None and plan.holds(texts)
        if point is None or not (covered or point.holds(texts)):
            spans.stats.fallbacks += 1
            return self._rendered(messages, tools, self._full(messages, tools), walked)
        cached = materialize(point.pieces, texts)
        if shape.verified < self.verify:
            try:
                full = self._full(messages, tools)
            except SampleError:
                shape.broken = True
                raise
            if full != cached:  # the symbolic render is not the real one here: never served again
                shape.broken = True
                spans.stats.fallbacks += 1
                return self._rendered(messages, tools, full, walked)
            shape.verified += 1
        else:
            full = cached
            spans.stats.full_served += 1
        found: dict[int, Span] = {}
        if covered and plan is not None:
            found = plan.spans(texts)
            spans.stats.served += 2 * len(found) - (len(messages) - 1 in found)
        covered_turns = plan.covered if covered and plan is not None else frozenset()
        built: list[ConversationRenders] = []

        def unplanned(i: int) -> Span:
            if not built:  # the renders, built once and only where a turn is not planned
                view = ShapeView(shape, texts, sentinel_copy, covered_turns)
                built.append(ConversationRenders(self, messages, tools, full=full, walked=walked, shape=view))
            return _turn_span(built[0], i)

        return RenderedText(text=full, assistant_spans=_spans(roles, found, unplanned))

    def conversation(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> ConversationRenders:
        """The renders of one conversation without the shape cache, its full text ``apply_chat_template``'s."""
        return ConversationRenders(self, messages, tools, full=self._full(messages, tools))

    def _rendered(
        self, messages: list[Message], tools: Any, full: str, walked: tuple[list[Message], Any] | None
    ) -> RenderedText:
        """Spans from renders, none from the shape cache (the renders after ``full`` direct where they can be)."""
        conv = ConversationRenders(self, messages, tools, full=full, walked=walked)
        roles = (
            message["role"] for message in conv.messages
        )  # read as the loop reaches each: a missing one raises there
        return RenderedText(text=full, assistant_spans=_spans(roles, {}, functools.partial(_turn_span, conv)))

    def _full(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
        return render(self.tokenizer, self.template, messages, generation_prompt=False, tools=tools)

    def _walked(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> tuple[list[Message], Any] | None:
        """The walked messages and tools; None where the walk raises or tools are callables (only
        ``apply_chat_template`` converts those) or transformers has no walk to reuse."""
        if not self.direct:
            return None
        ok, walked_tools = self.walk_tools(tools)
        if not ok:
            return None
        try:
            return self.walk(messages), walked_tools
        except Exception:  # apply_chat_template raises it (its own error row)
            return None

    def _sentinel_copy(self, messages: list[Message], i: int) -> Message:
        """Message ``i`` walked with its text swapped for :data:`SENTINEL` (as :meth:`ConversationRenders._direct`)."""
        return self.walk([_with_sentinel(messages[i])])[0]

    def walk(self, messages: list[Message]) -> list[Message]:
        """What ``apply_chat_template`` hands the template for ``messages`` (with ``direct`` set)."""
        if _NORMALIZE is None or _PLAIN is None or _ALIAS is None:
            raise TypeError("transformers has no chat input walk to reuse here")
        return list(_ALIAS(_PLAIN(_NORMALIZE(messages))))

    def walk_tools(self, tools: list[dict[str, Any]] | None) -> tuple[bool, Any]:
        """(False, None) where only ``apply_chat_template`` converts them (callables: JSON schemas built)."""
        if tools is None:
            return True, None
        if _PLAIN is None or not all(isinstance(tool, dict) for tool in tools):
            return False, None
        return True, _PLAIN(list(tools))


@dataclass(frozen=True, slots=True)
class ShapeView:
    """A conversation's shape renders: its texts, its sentinel copies, the renders whose checks it passed."""

    shape: ShapeRenders
    texts: list[str]
    sentinel_copy: Callable[[int], Message]
    covered: frozenset[RenderKey]


class ConversationRenders:
    """Every render one conversation's spans ask for, each done once (a last reply's prefix is the whole)."""

    def __init__(
        self,
        renderer: ChatRenderer,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        *,
        full: str,
        walked: tuple[list[Message], Any] | None = None,
        shape: ShapeView | None = None,
    ) -> None:
        """``walked``: the walked messages and tools if walked already; ``shape``: where the shape's full
        render with these texts is ``full`` (checked once for the shape, as the direct path checks it here
        otherwise); then the messages are walked only if a render is not served from the shape."""
        self.renderer = renderer
        self.messages = messages
        self.tools = tools
        self.full = full
        self._done: dict[RenderKey, str] = {(len(messages), False, None): self.full}
        self._walked: tuple[list[Message], Any] | None = walked
        self._shape = shape
        if shape is None and renderer.direct:
            self._walked = walked or renderer._walked(messages, tools)
            if self._walked is not None and self._direct(len(messages), False, None) != self.full:
                self._walked = None
        self._pending = shape is not None and walked is None and renderer.direct  # walk when first needed

    @property
    def direct(self) -> bool:
        """Whether the renders after the full text skip ``apply_chat_template``'s walk."""
        return self._walked is not None or self._pending

    def text(self, end: int, *, generation_prompt: bool, sentinel: int | None = None) -> str:
        """Render of ``messages[:end]``, message ``sentinel`` with its text swapped for :data:`SENTINEL`."""
        key = (end, generation_prompt, sentinel)
        done = self._done.get(key)
        if done is not None:
            return done
        view = self._shape
        if view is not None:
            point = view.shape.points.get(key) if key in view.covered else view.shape.point(key, view.sentinel_copy)
            if point is not None and (key in view.covered or point.holds(view.texts)):
                done = self._done[key] = materialize(point.pieces, view.texts)
                if self.renderer.spans is not None:
                    self.renderer.spans.stats.served += 1
                return done
        if self._pending:
            self._pending = False
            self._walked = self.renderer._walked(self.messages, self.tools)
        direct = self._direct(end, generation_prompt, sentinel)
        if direct is None:  # apply_chat_template's own text, or its own error
            messages = self.messages[:end]
            if sentinel is not None:
                messages[sentinel] = _with_sentinel(messages[sentinel])
            r = self.renderer
            direct = render(r.tokenizer, r.template, messages, generation_prompt=generation_prompt, tools=self.tools)
        self._done[key] = direct
        return direct

    def _direct(self, end: int, generation_prompt: bool, sentinel: int | None) -> str | None:
        """The compiled template on the walked messages; None where it raises (the caller asks
        ``apply_chat_template``, so an error row carries its message, never this path's)."""
        compiled, walked = self.renderer.compiled, self._walked
        if compiled is None or walked is None:
            return None
        messages = walked[0][:end]
        if sentinel is not None:
            messages[sentinel] = self.renderer.walk([_with_sentinel(self.messages[sentinel])])[0]
        try:
            return str(
                compiled.render(
                    messages=messages,
                    tools=walked[1],
                    documents=None,
                    add_generation_prompt=generation_prompt,
                    **self.renderer.variables,
                )
            )
        except Exception:  # jinja raises many types (TemplateError, TypeError, raise_exception)
            return None


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
    if not any(needed.values()):  # the usual sample: nothing to look up
        return
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


def _turn_span(conv: ConversationRenders, i: int) -> tuple[int, int]:
    """Character span of assistant turn ``i`` in the full text: by prefixes (2 renders), else by sentinel (2 more)."""
    if i == 0:  # no generation prompt to end at: the reply starts where its text does
        return _sentinel_span(conv, i, None)
    full = conv.full
    head = conv.text(i, generation_prompt=True)
    if full.startswith(head):
        turn = conv.text(i + 1, generation_prompt=False)
        if full.startswith(turn) and len(turn) >= len(head):
            return len(head), len(turn)
    return _sentinel_span(conv, i, head)


def _sentinel_span(conv: ConversationRenders, i: int, head: str | None) -> tuple[int, int]:
    """Turn ``i``'s span in a template that rewrites other turns depending on where the conversation ends.

    The full text with reply ``i`` swapped for :data:`SENTINEL` gives the reply's rendered text (what
    differs); the conversation ending at the sentinel reply gives the end-of-turn marker (after
    the sentinel) and the assistant header after the generation prompt ``head`` (before it).
    """
    full = conv.full
    whole = conv.text(len(conv.messages), generation_prompt=False, sentinel=i)
    ending = conv.text(i + 1, generation_prompt=False, sentinel=i)
    if whole.count(SENTINEL) != 1 or ending.count(SENTINEL) != 1:
        raise _span_error(i, "it does not render the reply's text exactly once, as given")
    before, after = whole.split(SENTINEL)
    header, closing = ending.split(SENTINEL)
    if not (full.startswith(before) and full.endswith(after) and len(before) + len(after) <= len(full)):
        moved = _moved_reasoning_span(full, before, after, conv.messages[i])
        if moved is None:
            raise _span_error(i, "changing this reply's text changes how it renders the other turns")
        if not full.startswith(closing, moved[1]):
            raise _span_error(i, f"the reply ends with {closing!r} when the conversation ends there, but not inside it")
        return moved[0], moved[1] + len(closing)
    reply_start, reply_end = len(before), len(full) - len(after)
    if not full.startswith(closing, reply_end):
        raise _span_error(i, f"the reply ends with {closing!r} when the conversation ends there, but not inside it")
    start = reply_start
    if head is not None and header.startswith(head) and full[:reply_start].endswith(header[len(head) :]):
        start -= len(header) - len(head)  # the assistant header after the generation prompt, as the prefix rule
    return start, reply_end + len(closing)


def _moved_reasoning_span(full: str, before: str, after: str, message: dict[str, Any]) -> tuple[int, int] | None:
    """Span of a reply whose inline ``<think>...</think>`` the template moved into a block of its own.

    Qwen3.5's template (MiniCPM-V 4.6's) renders a reply after the last user turn as
    ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, reasoning cut out of the reply's text, so the
    sentinel copy (no reasoning) renders ``<think>\\n\\n</think>\\n\\n`` + sentinel there. Accepted only
    where the full text and the sentinel render differ by exactly the reply's reasoning and answer
    in that wrapper, everything else equal: the span starts at the reasoning (after ``<think>\\n``, where
    a thinking generation prompt ends) and ends after the answer. None where that does not hold.
    """
    content = message.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        content = "".join(t for t in texts if isinstance(t, str)) if len(texts) == len(content) else None
    if not isinstance(content, str) or "</think>" not in content:
        return None
    reasoning = content.split("</think>")[0].split("<think>")[-1].strip()
    answer = content.split("</think>")[-1].strip()
    if not reasoning:
        return None
    p = 0
    while p < min(len(full), len(before)) and full[p] == before[p]:
        p += 1
    q = 0
    while q < min(len(full) - p, len(after)) and full[-1 - q] == after[-1 - q]:
        q += 1
    if full[p : len(full) - q] != reasoning + before[p:] + answer + after[: len(after) - q]:
        return None
    return p, len(full) - q


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
