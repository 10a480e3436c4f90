"""Per-worker cache of a chat template's renders by conversation shape, for span finding.

Finding the assistant spans of one conversation takes up to seven renders
(:mod:`prep.tokenize.template`); in a dataset most conversations share a few shapes (roles in
order, keys, content forms, image positions, tool calls). For each shape this cache renders, once,
every render the span search may ask for with the texts left symbolic
(:mod:`prep.tokenize.symbolic`), and then serves each conversation of that shape those renders
with its own texts put in, after checking that its texts answer every look the template took into
them as the symbolic render did. A render whose checks fail, or that the template could not render
symbolically, is rendered for real as before: the cache only skips renders whose text it proves.
A shape's renders are built when the span search first asks for them (a prefix-stable template
never needs the sentinel renders). The full render is served too, once the shape's first
conversation whose checks hold rendered exactly it through ``apply_chat_template`` (a shape that
does not is never served).

The shape (:func:`text_slots`): the walked messages (what the template receives) with every free
text value (a string ``content``, a content item's ``text``, reasoning fields) replaced by whether
it is empty, everything else by value and type (floats by ``repr``: ``-0.0`` renders differently
from ``0.0``), the tools by value, and where a message has keys set to None (the walk drops them,
a sentinel copy keeps their place) its keys in order. Messages of plain JSON types get it without
the walk (:func:`plain_text_slots`). Bounded: least recently used shapes go first.

Example: ``[user "Hi", assistant "Hello."]`` and ``[user "Bye", assistant "Ciao."]`` share one
shape; the second conversation's renders are the first's pieces with slots 0, 1 = ``"Bye"``,
``"Ciao."``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prep.tokenize.symbolic import Abort, Check, Pieces, Sym, SymbolicTemplate, Tracer

RenderKey = tuple[int, bool, int | None]  # (messages rendered, generation prompt, sentinel message)
TEXT_KEYS = ("content", "reasoning_content", "reasoning", "thinking")  # free text of a message
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS, in its order
_REASONING = frozenset(REASONING_KEYS)


@dataclass(frozen=True, slots=True)
class PointRender:
    """One render of a shape: its pieces and the checks the texts must pass for them to hold."""

    pieces: Pieces
    checks: tuple[Check, ...]

    def holds(self, texts: list[str]) -> bool:
        return all(check.holds(texts) for check in self.checks)


class ShapeRenders:
    """The renders of one shape, each built (texts symbolic) when first asked for; and whether the
    shape's full render was seen equal to ``apply_chat_template``'s (``verified`` conversations) or
    not (``broken``: never served). ``plan``: its spans as sums of lengths, set by the renderer."""

    def __init__(
        self,
        symbolic: SymbolicTemplate,
        variables: dict[str, Any],
        walked: list[dict[str, Any]],
        walked_tools: Any,
        texts: list[str],
    ) -> None:
        self.symbolic = symbolic
        self.variables = variables
        self.tracer = Tracer(skeleton_texts(texts))
        self.messages, self.tops = symbolic_messages(walked, self.tracer)
        self.tools = walked_tools
        self.points: dict[RenderKey, PointRender | None] = {}
        self.verified = 0
        self.broken = False
        self.plan: Any = None

    def point(self, key: RenderKey, sentinel_copy: Callable[[int], dict[str, Any]]) -> PointRender | None:
        """The render ``key`` (None where the template aborts or raises on it); ``sentinel_copy(i)``:
        the walked message ``i`` with its content swapped for the sentinel, of any conversation of the shape."""
        if key in self.points:
            return self.points[key]
        end, generation_prompt, sentinel = key
        rendered = self.messages[:end]
        if sentinel is not None:
            copy = symbolic_sentinel_copy(sentinel_copy(sentinel), self.tops[sentinel], self.tracer)
            if copy is None:
                self.points[key] = None
                return None
            rendered[sentinel] = copy
        context = {
            "messages": rendered,
            "tools": self.tools,
            "documents": None,
            "add_generation_prompt": generation_prompt,
        }
        point = self.points[key] = symbolic_point(self.symbolic, self.tracer, context, self.variables)
        return point


@dataclass(slots=True)
class CacheStats:
    """How often a conversation's shape was found, built, or its full render not served."""

    hits: int = 0
    misses: int = 0
    fallbacks: int = 0  # the full render's checks or text disagreed: every render done for real
    served: int = 0  # span renders taken from the cache (full renders not counted)
    full_served: int = 0  # full renders taken from the cache (no apply_chat_template)


@dataclass(slots=True)
class SpanCache:
    """Shape -> :class:`ShapeRenders`, least recently used first out; one per worker and template."""

    symbolic: SymbolicTemplate
    max_shapes: int = 1024
    shapes: OrderedDict[Hashable, ShapeRenders] = field(default_factory=OrderedDict)
    stats: CacheStats = field(default_factory=CacheStats)

    def renders(self, key: Hashable, build: Callable[[], ShapeRenders]) -> ShapeRenders:
        """The shape's renders, made by ``build()`` on a miss."""
        found = self.shapes.get(key)
        if found is not None:
            self.shapes.move_to_end(key)
            self.stats.hits += 1
            return found
        self.stats.misses += 1
        built = build()
        self.shapes[key] = built
        if len(self.shapes) > self.max_shapes:
            self.shapes.popitem(last=False)
        return built


class Unshaped(Exception):  # noqa: N818 (a reason to skip the cache, not an error)
    """A value the shape cannot hold exactly (a type outside plain JSON)."""


def text_slots(walked: list[dict[str, Any]], tools: Any, messages: list[Any]) -> tuple[Hashable, list[str]]:
    """The conversation's shape and its free texts, slot by slot (raises :class:`Unshaped`), from the
    walked messages and tools and the messages as given (where their keys set to None sit)."""
    texts: list[str] = []
    shape = tuple(_message_shape(m, texts) for m in walked)
    return (shape, _frozen(tools), _none_layout(messages)), texts


def plain_text_slots(messages: Any, tools: Any) -> tuple[Hashable, list[str]] | None:
    """:func:`text_slots` of messages and tools made of plain JSON types (exact ``dict``, ``list``,
    ``tuple``, ``str``, ``int``, ``float``, ``bool``, None), without transformers' walk; None otherwise.

    On such values the walk (``_normalize_chat_messages``, ``_plain_template_data``,
    ``_alias_reasoning_fields``) copies every value unchanged, drops a message's keys set to None and
    aliases its reasoning: done here on the message itself, the shape and texts are the walked ones.
    """
    if type(messages) is not list or not (tools is None or type(tools) is list):
        return None
    if tools is not None and not all(type(tool) is dict for tool in tools):
        return None
    texts: list[str] = []
    shapes: list[Hashable] = []
    layout: list[Hashable] = []
    try:
        for message in messages:
            if type(message) is not dict:
                return None
            if type(None) in map(type, message.values()):  # a value is None (types compare by identity)
                layout.append(tuple(key if type(key) is str else _frozen(key) for key in message))
                message = {key: value for key, value in message.items() if value is not None}
            else:
                layout.append(None)
            if not _REASONING.isdisjoint(message):  # one C call where no message reasons (the usual one)
                reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
                if reasoning is not None:
                    message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            shapes.append(_message_shape(message, texts))
        return (tuple(shapes), _frozen(tools), tuple(layout)), texts
    except Unshaped:
        return None


def _none_layout(messages: list[Any]) -> Hashable:
    """Per message, its keys in order where some are set to None (a sentinel copy puts its content there)."""
    return tuple(
        tuple(_key(k) for k in m) if isinstance(m, Mapping) and any(v is None for v in m.values()) else None
        for m in messages
    )


def _message_shape(message: dict[str, Any], texts: list[str]) -> Hashable:
    """Per key: its text's emptiness (the text to ``texts``), its items' shapes, or its frozen value;
    a string value's ``_frozen`` written out (most values are strings: roles, texts; it runs per message)."""
    out: list[tuple[Hashable, Hashable]] = []
    for key, value in message.items():
        name = key if type(key) is str else _frozen(key)
        kind = type(value)
        if kind is str:
            if name in TEXT_KEYS:
                texts.append(value)
                out.append((name, ("text", bool(value))))
            else:
                out.append((name, ("str", value)))
        elif name == "content" and kind is list:
            out.append((name, ("items", tuple([_item_shape(item, texts) for item in value]))))
        else:
            out.append((name, _frozen(value)))
    return tuple(out)


def _item_shape(item: Any, texts: list[str]) -> Hashable:
    if type(item) is dict and item.get("type") == "text" and type(item.get("text")) is str:
        out: list[tuple[Hashable, Hashable]] = []
        for key, value in item.items():
            name = key if type(key) is str else _frozen(key)
            if name == "text":
                texts.append(value)
                out.append((name, ("text", bool(value))))
            else:
                out.append((name, _frozen(value)))
        return ("text-item", tuple(out))
    return _frozen(item)


def _key(key: Any) -> Hashable:
    """A dict key as the walk leaves it (a str as itself; other plain values frozen; others: :class:`Unshaped`)."""
    return key if type(key) is str else _frozen(key)


def _frozen(value: Any) -> Hashable:
    """Hashable, equal only for values every template renders alike (types kept, floats by repr).

    (Tuples of lists, not of generators: this runs for every content item of every sample.)"""
    kind = type(value)
    if value is None or kind in (str, int, bool):
        return (kind.__name__, value)
    if kind is float:
        return ("float", repr(value))
    if kind is dict:
        return ("dict", tuple([(_frozen(k), _frozen(v)) for k, v in value.items()]))
    if kind in (list, tuple):
        return (kind.__name__, tuple([_frozen(v) for v in value]))
    raise Unshaped(kind.__name__)


def symbolic_messages(
    walked: list[dict[str, Any]], tracer: Tracer
) -> tuple[list[dict[str, Any]], list[dict[str, int]]]:
    """The walked messages with slot ``k``'s text replaced by a :class:`Sym` (same order as :func:`text_slots`),
    and each message's top-level text keys -> slot (what a sentinel copy of the message keeps)."""
    counter = iter(range(1 << 62))
    out, tops = [], []
    for message in walked:
        top: dict[str, int] = {}
        sym: dict[str, Any] = {}
        for key, value in message.items():
            if key in TEXT_KEYS and type(value) is str:
                top[key] = next(counter)
                sym[key] = Sym((top[key],), tracer)
            elif key == "content" and type(value) is list:
                sym[key] = [_symbolic_item(item, tracer, counter) for item in value]
            else:
                sym[key] = value
        out.append(sym)
        tops.append(top)
    return out, tops


def _symbolic_item(item: Any, tracer: Tracer, counter: Any) -> Any:
    if type(item) is dict and item.get("type") == "text" and type(item.get("text")) is str:
        return {k: Sym((next(counter),), tracer) if k == "text" else v for k, v in item.items()}
    return item


def symbolic_sentinel_copy(walked: dict[str, Any], top: dict[str, int], tracer: Tracer) -> dict[str, Any] | None:
    """A walked sentinel copy of a message (content swapped for the sentinel) with its other texts symbolic;
    None where it holds a text the original did not (no slot to put it in)."""
    out: dict[str, Any] = {}
    for key, value in walked.items():
        if key != "content" and key in TEXT_KEYS and type(value) is str:
            if key not in top:
                return None
            out[key] = Sym((top[key],), tracer)
        else:
            out[key] = value
    return out


def skeleton_texts(texts: list[str]) -> list[str]:
    """A stand-in per slot: empty where the text is (the shape holds that), else a plain word."""
    return [f"PVLMS{k}Q" if text else "" for k, text in enumerate(texts)]


def symbolic_point(
    symbolic: SymbolicTemplate, tracer: Tracer, context: dict[str, Any], variables: dict[str, Any]
) -> PointRender | None:
    """One symbolic render, or None where the template aborts or raises (that render is done for real).

    ``context`` and ``variables`` are passed as the direct render passes them (a clash raises, as there).
    """
    try:
        pieces, checks = symbolic.render(tracer, **context, **variables)
    except Abort:
        return None
    except Exception:  # jinja raises many types; the real render raises too, or takes another path
        return None
    return PointRender(pieces, tuple(checks))
