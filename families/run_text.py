"""A text declared as literal pieces and runs of one token: how a counter hands a media expansion.

A Kimi K2.5 video expands to ~51 KB of text, almost all of it ``<|kimi_k25_video_placeholder|>``
copies (a Gemma 3 image: 256 ``<image_soft_token>``). Declared as pieces, the tokenizer
(`prep.tokenize.runs`) cuts each run to one copy without building, searching or slicing the
whole text; ``text`` builds it, and it is the truth every other use reads.

Example: ``RunText(literals=("00:00 <|image>", "<image|>"), runs=(("<|video|>", 3),))`` is
``"00:00 <|image><|video|><|video|><|video|><image|>"``, 41 characters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Piece = str | tuple[str, int]  # literal text, or (token text, copies)


@dataclass(frozen=True, slots=True)
class RunText:
    """``literals[0] + runs[0][0] * runs[0][1] + literals[1] + ... + literals[-1]``."""

    literals: tuple[str, ...]  # one more than runs: the text before, between and after them
    runs: tuple[tuple[str, int], ...]  # (token text, copies)
    num_chars: int = field(init=False, repr=False, compare=False)  # len(text)

    def __post_init__(self) -> None:
        if len(self.literals) != len(self.runs) + 1:
            raise ValueError(f"RunText needs one literal more than runs: {len(self.literals)} for {len(self.runs)}")
        size = sum(map(len, self.literals)) + sum(len(token) * copies for token, copies in self.runs)
        object.__setattr__(self, "num_chars", size)

    @classmethod
    def of(cls, pieces: Iterable[Piece | RunText]) -> RunText:
        """The text of ``pieces`` in order: adjacent literals joined, runs of under two copies written out."""
        literals: list[str] = []
        runs: list[tuple[str, int]] = []
        pending: list[str] = []
        for piece in pieces:
            if isinstance(piece, str):
                pending.append(piece)
            elif isinstance(piece, RunText):
                pending.append(piece.literals[0])
                if piece.runs:
                    literals.append("".join(pending))
                    literals += piece.literals[1:-1]
                    runs += piece.runs
                    pending = [piece.literals[-1]]
            elif piece[1] < 2:
                pending.append(piece[0] * piece[1])
            else:
                literals.append("".join(pending))
                runs.append(piece)
                pending = []
        literals.append("".join(pending))
        return cls(tuple(literals), tuple(runs))

    @property
    def text(self) -> str:
        """The whole text (built on each call)."""
        parts = [self.literals[0]]
        for (token, copies), literal in zip(self.runs, self.literals[1:], strict=True):
            parts.append(token * copies)
            parts.append(literal)
        return "".join(parts)

    def __str__(self) -> str:
        return self.text

    def startswith(self, prefix: str) -> bool:
        """``self.text.startswith(prefix)``, reading only the first ``len(prefix)`` characters."""
        head: list[str] = []
        size = 0
        for literal, (token, copies) in zip(self.literals, (*self.runs, ("", 0)), strict=True):
            if size >= len(prefix):
                break
            head.append(literal)
            size += len(literal)
            if size < len(prefix) and copies:
                head.append(token * min(copies, len(prefix) // max(len(token), 1) + 1))
                size += len(head[-1])
        return "".join(head).startswith(prefix)
