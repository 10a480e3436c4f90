"""A cached shape's assistant spans as sums of lengths, where its prefix renders are prefixes piece by piece.

:func:`prep.tokenize.template._turn_span` takes turn ``i``'s span from two renders when both are
prefixes of the full render: ``head`` (the conversation up to the turn, with the generation
prompt) and ``turn`` (up to and with the turn); the span is ``[len(head), len(turn))``. For a
cached shape the three are pieces (:mod:`prep.tokenize.symbolic`): literal template text and text
slots. Where ``head``'s pieces are the full render's first pieces (its last literal may be a
prefix of the full render's literal there), ``head`` is a prefix of the full render whatever the
texts are, and its length is its literals' length plus the lengths of its slots' texts. So a
conversation of the shape whose texts pass the checks of the shape's renders (one deduplicated
tuple for all of them) gets its spans without materializing a prefix render. A turn whose renders
are not prefixes piece by piece (a text-dependent prefix, a sentinel search) has no plan: the
renders answer it as before, each taken from the shape without checking it again.

Example (ChatML, ``[user, assistant]``): full ``("<|im_start|>user\\n", 0,
"<|im_end|>\\n<|im_start|>assistant\\n", 1, "<|im_end|>\\n")``, head ``("<|im_start|>user\\n", 0,
"<|im_end|>\\n<|im_start|>assistant\\n")``: the reply starts at ``len(texts[0]) + 43``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prep.tokenize.span_cache import PointRender, RenderKey, ShapeRenders
from prep.tokenize.symbolic import Check, Pieces

LengthForm = tuple[int, tuple[int, ...]]  # characters of literal text, slots whose text lengths add


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """Assistant turn ``index``: its span runs from the length of ``head`` to the length of ``turn``."""

    index: int
    head: LengthForm
    turn: LengthForm


@dataclass(frozen=True, slots=True)
class SpanPlan:
    """What a conversation of a shape needs to take its renders from the shape: one check tuple
    (every built render's checks, each once), the renders it covers, the turns whose span is a sum of lengths."""

    checks: tuple[Check, ...]
    covered: frozenset[RenderKey]  # the shape's renders that built (their checks are ``checks``)
    turns: tuple[TurnPlan, ...]
    built: int  # renders of the shape tried when this plan was made (a later one makes a new plan)
    testers: tuple[Callable[[list[str]], bool], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "testers", tuple(check.tester() for check in self.checks))

    def holds(self, texts: list[str]) -> bool:
        return all(test(texts) for test in self.testers)

    def spans(self, texts: list[str]) -> dict[int, tuple[int, int]]:
        """The planned turns' spans (where the texts pass :meth:`holds`); a turn whose prefix render is
        longer than the turn's render is left to the renders, as ``_turn_span`` looks further there."""
        lengths = list(map(len, texts))
        found = {}
        for turn in self.turns:
            start, end = length(turn.head, lengths), length(turn.turn, lengths)
            if end >= start:
                found[turn.index] = (start, end)
        return found


def span_plan(
    shape: ShapeRenders, full: PointRender, roles: list[Any], sentinel_copy: Callable[[int], dict[str, Any]]
) -> SpanPlan:
    """The shape's plan, made again when the span search built more of its renders since.

    The first plan builds every assistant turn's generation-prompt render (where ``_turn_span`` starts) and,
    where that is a prefix of the full render piece by piece, the turn's render; turn ``i`` is planned
    where both are. (Any other render is built when the span search first asks for it.)
    """
    plan: SpanPlan | None = shape.plan
    if plan is not None and plan.built == len(shape.points):
        return plan
    assistants = [i for i, role in enumerate(roles) if i > 0 and not role != "assistant"]
    if plan is None:
        for i in assistants:
            head = shape.point((i, True, None), sentinel_copy)
            if head is not None and is_piece_prefix(head.pieces, full.pieces):
                shape.point((i + 1, False, None), sentinel_copy)
    points = {key: point for key, point in shape.points.items() if point is not None}
    turns = []
    for i in assistants:
        head, turn = points.get((i, True, None)), points.get((i + 1, False, None))
        if head is not None and turn is not None:
            if is_piece_prefix(head.pieces, full.pieces) and is_piece_prefix(turn.pieces, full.pieces):
                turns.append(TurnPlan(i, length_form(head.pieces), length_form(turn.pieces)))
    checks = unique_checks([point.checks for point in points.values()])
    shape.plan = plan = SpanPlan(checks, frozenset(points), tuple(turns), len(shape.points))
    return plan


def is_piece_prefix(head: Pieces, full: Pieces) -> bool:
    """Whether ``head`` renders a prefix of ``full`` for every text assignment (both merged pieces)."""
    if len(head) > len(full):
        return False
    last = len(head) - 1
    for k, piece in enumerate(head):
        other = full[k]
        if piece == other and type(piece) is type(other):
            continue
        if k == last and type(piece) is str and type(other) is str and other.startswith(piece):
            continue
        return False
    return True


def length_form(pieces: Pieces) -> LengthForm:
    """The render's length as literal characters plus text slots."""
    return sum(len(p) for p in pieces if type(p) is str), tuple(p for p in pieces if type(p) is int)


def length(form: LengthForm, lengths: list[int]) -> int:
    """The length of a render of ``form`` whose slots hold texts of ``lengths``."""
    constant, slots = form
    return constant + sum(map(lengths.__getitem__, slots))  # map, not a generator: it runs per turn per sample


def unique_checks(groups: list[tuple[Check, ...]]) -> tuple[Check, ...]:
    """The checks of several renders, each once (a shape's renders share most of them), in order.

    Compared by ``repr``: equal checks have equal reprs, and ``True`` and ``1`` (equal, one hash) differ there.
    """
    return tuple({repr(check): check for group in groups for check in group}.values())
