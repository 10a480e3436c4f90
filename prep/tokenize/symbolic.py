"""A chat template rendered with a conversation's text values left symbolic.

Span finding renders one conversation up to seven times (:mod:`prep.tokenize.template`).
Conversations of one *shape* (roles, keys, content forms, tool calls: everything but the free
text) differ only in their text values, so their renders are the same pieces of template text
with the texts in between, provided the template never looks *into* a text. This module renders
a template once per shape with every text value replaced by a :class:`Sym`, an opaque object
standing for "slot k" (or a concatenation of slots and literals), and records every look into a
text (``'</think>' in content``, ``content | trim``, ``text.split(...)``) as a :class:`Check`,
whose answer on the real texts must be the one the symbolic render took.

Why a render is exact: the template runs on plain Python values; a :class:`Sym` is no ``str``, so
any code that reads its value goes through one of its methods (C code that reads ``str`` buffers
refuses it with a TypeError). Each method either builds another :class:`Sym` without reading a
value (``+``, ``~``, captured output), answers from the shape (truthiness: whether each slot is
empty is part of the shape), records a :class:`Check` (a ``str`` method whose result is a bool, an
int, the text unchanged or ``[the text]``), or raises :class:`Abort` (anything else). If the render
finishes, every branch it took depended on non-text values, shape facts or recorded checks; so a
real conversation of the same shape whose checks all give the recorded answers runs the template
through the same steps, each text-derived value equal to its symbol with the real texts put in,
and renders exactly :func:`materialize` of the symbolic output. Nothing is guessed: a render that
aborts is simply not cached, and a sample whose checks differ renders for real. The render must
also depend on nothing but its inputs: the environment's functions that read the clock or draw
random numbers (transformers' ``strftime_now``, jinja's ``random`` filter and ``lipsum``, and any
function it does not know) abort when a template calls them.

Example (ChatML): ``<|im_start|>user\\n{{ content }}<|im_end|>`` with content slot 0 renders the
pieces ``("<|im_start|>user\\n", 0, "<|im_end|>")``; with slot 0 = ``"Hi"`` that is the real render.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from jinja2 import pass_eval_context
from jinja2.defaults import DEFAULT_FILTERS, DEFAULT_NAMESPACE, DEFAULT_TESTS
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

Piece = str | int  # literal template text, or the index of a text slot
Pieces = tuple[Piece, ...]


class Abort(Exception):  # noqa: N818 (not an error: the render is just not cacheable)
    """The template did something with a text value that cannot be checked on other texts."""


def materialize(pieces: Pieces, texts: list[str]) -> str:
    """The render with ``texts`` in the slots (a list, not a generator, for ``join``: it runs per served render)."""
    return "".join([p if isinstance(p, str) else texts[p] for p in pieces])


@dataclass(frozen=True, slots=True)
class SymArg:
    """A symbolic argument of a recorded check."""

    pieces: Pieces


_SAME = "same"  # the method returned its receiver unchanged
_SAME_LIST = "[same]"  # ... as a one-element list (``split`` finding no separator)

# the value-reading operations a Sym allows, as functions of the receiver string
_DUNDERS: dict[str, Callable[..., Any]] = {
    "__eq__": operator.eq,
    "__ne__": operator.ne,
    "__contains__": operator.contains,
    "__len__": len,
}
_ANSWERS = (bool, int, type(None))


@dataclass(frozen=True, slots=True)
class Check:
    """One look into text values and the answer the symbolic render went on with."""

    method: str
    receiver: Pieces
    args: tuple[Any, ...]  # plain values or SymArg
    kwargs: tuple[tuple[str, Any], ...]
    expected: Any  # _SAME, _SAME_LIST, or a bool / int / None

    def holds(self, texts: list[str]) -> bool:
        """Whether the real texts give the recorded answer (any exception: they do not)."""
        receiver = materialize(self.receiver, texts)
        args = [materialize(a.pieces, texts) if isinstance(a, SymArg) else a for a in self.args]
        try:
            result = _function(self.method)(receiver, *args, **dict(self.kwargs))
        except Exception:  # the symbolic render saw no exception here: a different path
            return False
        if self.expected == _SAME and isinstance(self.expected, str):
            return type(result) is str and result == receiver
        if self.expected == _SAME_LIST and isinstance(self.expected, str):
            return type(result) is list and result == [receiver]
        return type(result) is type(self.expected) and result == self.expected

    def tester(self) -> Callable[[list[str]], bool]:
        """:meth:`holds` as a function, specialised where the receiver is one slot and no argument is a text."""
        receiver, args, expected = self.receiver, self.args, self.expected
        if len(receiver) != 1 or type(receiver[0]) is not int or any(isinstance(a, SymArg) for a in args):
            return self.holds
        if any(isinstance(v, SymArg) for _, v in self.kwargs):
            return self.holds
        slot, fn, kwargs = receiver[0], _function(self.method), dict(self.kwargs)
        same = self.expected == _SAME and isinstance(self.expected, str)
        same_list = self.expected == _SAME_LIST and isinstance(self.expected, str)

        def holds(texts: list[str]) -> bool:
            text = texts[slot]
            try:
                result = fn(text, *args, **kwargs)
            except Exception:  # as holds
                return False
            if same:
                return type(result) is str and result == text
            if same_list:
                return type(result) is list and result == [text]
            return type(result) is type(expected) and result == expected

        return holds


def _function(method: str) -> Callable[..., Any]:
    fn = _DUNDERS.get(method)
    return fn if fn is not None else getattr(str, method)


class Tracer:
    """The skeleton texts of one shape (a value per slot) and the checks one render recorded."""

    def __init__(self, skeleton: list[str]) -> None:
        self.skeleton = skeleton
        self.checks: list[Check] = []


class Sym:
    """An opaque text value: slots and literals, read only through recorded checks."""

    __slots__ = ("_pieces", "_tracer")

    def __init__(self, pieces: Pieces, tracer: Tracer) -> None:
        self._pieces = pieces  # underscore names: the sandbox hides them from templates (a str has none)
        self._tracer = tracer

    @property
    def _skeleton(self) -> str:
        return materialize(self._pieces, self._tracer.skeleton)

    def __bool__(self) -> bool:  # from the shape: which slots are empty is part of it
        return bool(self._skeleton)

    def __add__(self, other: object) -> Sym:
        return join_values([self, other], self._tracer)

    def __radd__(self, other: object) -> Sym:
        return join_values([other, self], self._tracer)

    def __eq__(self, other: object) -> Any:
        return self._observe("__eq__", other)

    def __ne__(self, other: object) -> Any:
        return self._observe("__ne__", other)

    def __contains__(self, item: object) -> Any:
        return self._observe("__contains__", item)

    def __len__(self) -> Any:
        return self._observe("__len__")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not callable(getattr(str, name, None)):
            raise AttributeError(name)  # as str has none (jinja then tries [name]: __getitem__ aborts)
        return functools.partial(self._observe, name)

    def _observe(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a str operation on the skeleton; keep its answer as a check, or abort."""
        for value in (*args, *kwargs.values()):
            if not isinstance(value, (Sym, str, *_ANSWERS)):
                raise Abort(f"{method} with a {type(value).__name__} argument")
        skeleton = [a._skeleton if isinstance(a, Sym) else a for a in args]
        plain = {k: v._skeleton if isinstance(v, Sym) else v for k, v in kwargs.items()}
        result = _function(method)(self._skeleton, *skeleton, **plain)
        expected: Any
        out: Any
        if isinstance(result, _ANSWERS):
            expected, out = result, result
        elif type(result) is str and result == self._skeleton:
            expected, out = _SAME, self
        elif type(result) is list and result == [self._skeleton]:
            expected, out = _SAME_LIST, [self]
        else:
            raise Abort(f"{method} derives a new text")
        sym_args = tuple(SymArg(a._pieces) if isinstance(a, Sym) else a for a in args)
        sym_kwargs = tuple((k, SymArg(v._pieces) if isinstance(v, Sym) else v) for k, v in kwargs.items())
        self._tracer.checks.append(Check(method, self._pieces, sym_args, sym_kwargs, expected))
        return out

    def _abort(self, *args: Any, **kwargs: Any) -> Any:
        raise Abort("an operation that reads a text value without a check")

    # everything else a str answers: abort (not TypeError, which filters like ``int`` catch to take
    # another path than a str would); no __call__ (a str is not callable), no __html__
    __str__ = __repr__ = __format__ = __bytes__ = __hash__ = __iter__ = __getitem__ = __reversed__ = _abort
    __lt__ = __le__ = __gt__ = __ge__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _abort
    __int__ = __float__ = __index__ = __complex__ = __round__ = __trunc__ = __floor__ = __ceil__ = _abort
    __abs__ = __neg__ = __pos__ = __invert__ = __sub__ = __rsub__ = __truediv__ = __rtruediv__ = _abort
    __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = __divmod__ = __rdivmod__ = _abort
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __lshift__ = __rshift__ = _abort


class SymStr(str):
    """A :class:`Sym` on its way from an output statement to the buffer's ``concat``."""

    sym: Sym

    def __str__(self) -> str:  # the compiled output is ``str(finalize(x))``: keep the symbol
        return self


def join_values(values: Iterable[object], tracer: Tracer) -> Sym:
    """Concatenation of strings and symbols (anything else would need ``str()`` of it: abort)."""
    pieces: list[Piece] = []
    for value in values:
        if isinstance(value, SymStr):
            value = value.sym
        if isinstance(value, Sym):
            pieces.extend(value._pieces)
        elif isinstance(value, str):
            pieces.append(value)
        else:
            raise Abort(f"concatenation with a {type(value).__name__}")
    return Sym(_merged(pieces), tracer)


def _merged(pieces: list[Piece]) -> Pieces:
    """Adjacent literals joined, empty ones dropped."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += piece
                continue
        out.append(piece)
    return tuple(out)


class SymbolicEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with every path a text value can take kept symbolic.

    Output goes through ``finalize`` (a :class:`Sym` becomes a :class:`SymStr`), buffers through
    ``concat`` (symbolic when any part is), binary operators through ``call_binop`` (``+`` joins,
    others abort on a symbol), the ``string``/``sequence``/``iterable`` tests answer for a text as
    for a ``str``, ``trim`` is recorded as ``strip``. On plain values each does what the original does.
    """

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def __init__(self, base: Any, tracer_box: list[Tracer]) -> None:
        super().__init__(
            trim_blocks=base.trim_blocks,
            lstrip_blocks=base.lstrip_blocks,
            extensions=[type(ext) for ext in base.extensions.values()],
            finalize=_finalize,
        )
        self.filters.update(base.filters)
        self.tests.update(base.tests)
        self.globals.update(base.globals)
        self.policies.update(base.policies)
        _only_pure(self.filters, DEFAULT_FILTERS)
        _only_pure(self.tests, DEFAULT_TESTS)
        _only_pure(self.globals, DEFAULT_NAMESPACE)
        self._tracer_box = tracer_box
        self.concat = self._concat  # type: ignore[method-assign]
        _wrap_tests(self.tests)
        trim = self.filters["trim"]
        self.filters["trim"] = lambda value, chars=None: (
            value._observe("strip", chars) if isinstance(value, Sym) else trim(value, chars)
        )
        string = self.filters["string"]
        self.filters["string"] = lambda value: value if isinstance(value, Sym) else string(value)
        self.filters["join"] = _symbolic_join(self.filters["join"], tracer_box)

    def _concat(self, parts: Iterable[str]) -> Any:
        parts = list(parts)
        if any(isinstance(p, SymStr) for p in parts):
            return join_values(parts, self._tracer_box[0])
        return "".join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if isinstance(left, Sym) or isinstance(right, Sym):
            if operator == "+":
                return join_values([left, right], self._tracer_box[0])
            raise Abort(f"operator {operator} on a text value")
        return super().call_binop(context, operator, left, right)


# jinja's own functions that draw random numbers: ``random`` (filter), ``lipsum`` (global)
_IMPURE = frozenset({"random", "lipsum"})
# transformers' template functions (``utils/chat_template_utils.py``, ``_compile_jinja_template``) whose
# result depends only on their arguments; its ``strftime_now`` reads the clock (Llama's templates print the date)
_PURE_TRANSFORMERS = frozenset({"tojson", "raise_exception", "TemplateDict", "TemplateNamespace"})
_TRANSFORMERS_MODULE = "transformers.utils.chat_template_utils"


def _only_pure(table: dict[str, Any], jinja_defaults: dict[str, Any]) -> None:
    """Every filter, test or global the render could see whose result is not a function of its arguments
    (the clock, random draws, anything not known) aborts when called: a render that printed today's date
    or a random pick would be served to later conversations of its shape."""
    for name, value in list(table.items()):
        if not _pure(name, value, jinja_defaults):
            table[name] = functools.partial(_aborting, name)


def _pure(name: str, value: Any, jinja_defaults: dict[str, Any]) -> bool:
    if value is None or type(value) in (str, int, float, bool):
        return True
    if value is jinja_defaults.get(name) or value is safe_range:
        return name not in _IMPURE
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None)
    return module == _TRANSFORMERS_MODULE and qualname.rsplit(".", 1)[-1] in _PURE_TRANSFORMERS


def _aborting(name: str, *args: Any, **kwargs: Any) -> Any:
    raise Abort(f"{name} does not depend only on its arguments")


def _symbolic_join(join: Callable[..., Any], tracer_box: list[Tracer]) -> Callable[..., Any]:
    """jinja's ``join`` filter, joining text values symbolically (``str(d).join(map(str, items))``
    with each text a slot); anything else it reads (an attribute, autoescape, a text as the
    separator or as the sequence) goes to the original, which aborts on a symbol."""

    @pass_eval_context
    def _join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        if attribute is not None or eval_ctx.autoescape or isinstance(d, (Sym, SymStr)) or isinstance(value, Sym):
            return join(eval_ctx, value, d, attribute)
        items = list(value)
        if not any(isinstance(item, (Sym, SymStr)) for item in items):
            return join(eval_ctx, items, d, attribute)
        parts: list[object] = []
        for i, item in enumerate(items):
            if i:
                parts.append(str(d))
            parts.append(item if isinstance(item, (Sym, SymStr)) else str(item))
        return join_values(parts, tracer_box[0])

    return _join


def _finalize(value: Any) -> Any:
    if isinstance(value, Sym):
        out = SymStr(value._skeleton)
        out.sym = value
        return out
    return value


def _wrap_tests(tests: dict[str, Any]) -> None:
    """A text is a string, a sequence and iterable (as a str is); ``sameas`` on one is identity: abort."""
    for name in ("string", "sequence", "iterable"):
        original = tests[name]
        tests[name] = functools.partial(_str_like_test, original)
    sameas = tests["sameas"]

    def _sameas(value: Any, other: Any) -> bool:
        if isinstance(value, Sym) or isinstance(other, Sym):
            raise Abort("sameas on a text value")
        return bool(sameas(value, other))

    tests["sameas"] = _sameas


def _str_like_test(original: Callable[[Any], bool], value: Any) -> bool:
    return True if isinstance(value, Sym) else original(value)


class SymbolicTemplate:
    """One chat template compiled in a :class:`SymbolicEnvironment`, rendered with symbolic texts."""

    def __init__(self, compiled: Any, template: str) -> None:
        self._tracer_box: list[Tracer] = [Tracer([])]
        self.environment = SymbolicEnvironment(compiled.environment, self._tracer_box)
        self.template = self.environment.from_string(template)
        namespace = self.template.root_render_func.__globals__  # the compiled module's ``~`` helpers
        namespace["str_join"] = namespace["markup_join"] = self._str_join

    def render(self, tracer: Tracer, **variables: Any) -> tuple[Pieces, list[Check]]:
        """The render's pieces and its checks; raises :class:`Abort` or whatever the template raises.

        Runs the compiled render function as ``Template.render`` does, without its exception
        handler: that handler re-raises from a frame holding the exception (a reference cycle
        keeping every caller's frame, and the worker's tokenizer and LMDB environments, alive
        until the cyclic collector runs), and a render that aborts is an everyday event here.
        """
        self._tracer_box[0] = tracer
        tracer.checks = []
        template = self.template
        out = template.environment.concat(template.root_render_func(template.new_context(variables)))
        pieces = out._pieces if isinstance(out, Sym) else _merged([str(out)])
        return pieces, tracer.checks

    def _str_join(self, seq: Iterable[Any]) -> Any:
        items = list(seq)
        if any(isinstance(v, Sym) for v in items):
            return join_values([v if isinstance(v, Sym) else str(v) for v in items], self._tracer_box[0])
        return "".join(map(str, items))
