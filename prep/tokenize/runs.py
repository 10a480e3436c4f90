"""Tokenize text whose media expansions repeat one added token many times, once per run.

Gemma 3 writes 256 ``<image_soft_token>`` per image into the text (Idefics3 a tile's worth of
``<image>``, Kimi K2.5 hundreds of placeholders per video chunk): the tokenizer's added-token
matcher then makes one piece per copy, and a sample with two images cost ~4 ms there alone. An
added token ``X`` that is matched on the raw text (``normalized`` false), has no ``lstrip`` /
``rstrip`` / ``single_word`` rule and overlaps no added token (no other contains it or is
contained in it, no proper suffix of one is a prefix of the other, ``X`` included against
itself) tokenizes the same in any text ``A + X * k + B`` as in ``A + X + B`` with its id
repeated k times: every added-token match touching the run is then a whole copy of ``X``, so
the pieces between matches (what BPE sees) are the same in both texts.

The runs are the ones the counters declare (`families.run_text.RunText`, spliced in by
`prep.tokenize.expansion`): the short text is built from the pieces, each run of a compressible
token cut to one copy (any other run written out), and the whole text is never built unless
the short text's offsets decrease somewhere or its tokens fail the check (`_Cut.kept`: each kept
copy one token of its own offsets and id); then the whole text is tokenized as it is. Every run
lies in a media span, so its copies' mask is 0; the other tokens' mask is the overlap rule with
the spans moved onto the short text (`_Cut.short`).

Example: ``"Look:\\n\\n<boi>" + "<soft>" * 256 + "<eoi>\\n\\nCat"`` is tokenized as
``"Look:\\n\\n<boi><soft><eoi>\\n\\nCat"``, then the ``<soft>`` id is repeated 256 times with
mask 0; a span ending at the full text's ``Cat`` ends at the short text's ``Cat``.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from families.run_text import RunText
from prep.tokenize.expansion import ExpandedText
from prep.tokenize.offsets import encode_pairs, pairs_mask, sorted_pairs_mask

_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _overlaps(a: str, b: str) -> bool:
    """A proper suffix of ``a`` is a prefix of ``b``."""
    return any(a[-k:] == b[:k] for k in range(1, min(len(a), len(b))))


class RunEncoder:
    """Per worker: which added tokens compress (decided once per token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.added = {token.content: (token_id, token) for token_id, token in added.items()}
        self.eligible: dict[str, bool] = {}

    def compressible(self, content: str) -> bool:
        """``content`` is an added token whose runs tokenize as one copy (see the module docstring)."""
        if content not in self.eligible:
            self.eligible[content] = self._check(content)
        return self.eligible[content]

    def _check(self, x: str) -> bool:
        entry = self.added.get(x)
        if entry is None or not x:
            return False
        token = entry[1]
        if token.normalized or token.lstrip or token.rstrip or token.single_word or _overlaps(x, x):
            return False
        for other in self.added:
            if other != x and (x in other or other in x or _overlaps(x, other) or _overlaps(other, x)):
                return False
        return True

    def encode_masked(
        self, expanded: ExpandedText, add_special_tokens: bool
    ) -> tuple[list[int], npt.NDArray[np.uint8]]:
        """Ids of ``expanded.text`` as ``tokenizer(text)`` gives them and the loss mask of their offsets
        (:func:`~prep.tokenize.offsets.overlap_mask` of its assistant and media spans)."""
        spans, media = expanded.assistant_spans, expanded.media_spans
        if not getattr(self.tokenizer, "split_special_tokens", False):
            cut = self._cut(expanded.pieces)
            ids, pairs = encode_pairs(self.tokenizer, cut.text, add_special_tokens)
            if not cut.starts:  # nothing cut: the short text is the whole text
                return ids, pairs_mask(pairs, spans, media)
            starts, ends = list(map(_FIRST, pairs)), list(map(_SECOND, pairs))
            if starts == sorted(starts) and ends == sorted(ends):
                hits = cut.kept(ids, starts, ends)
                if hits is not None:
                    mask = sorted_pairs_mask(starts, ends, cut.short(spans), cut.short(media))
                    return cut.expand(ids, mask, hits)
        ids, pairs = encode_pairs(self.tokenizer, expanded.text, add_special_tokens)
        return ids, pairs_mask(pairs, spans, media)

    def _cut(self, pieces: RunText) -> _Cut:
        """The text of ``pieces`` with each run of a compressible token cut to its first copy.

        Whole-list steps, not one per run: a video declares a run per frame (Gemma 4: 32 a clip)."""
        literals, runs = pieces.literals, pieces.runs
        tokens = [x for x, _ in runs]
        copies = [count for _, count in runs]
        if runs and (min(copies) < 2 or not all(map(self.compressible, set(tokens)))):
            literals, runs = self._written_out(pieces)
            tokens = [x for x, _ in runs]
            copies = [count for _, count in runs]
        parts = [""] * (2 * len(runs) + 1)
        parts[0::2] = literals
        parts[1::2] = tokens
        widths = list(map(len, tokens))
        starts = list(itertools.accumulate(map(len, parts[:-1])))[0::2]  # each kept copy's start
        drops = list(itertools.accumulate((count - 1) * width for count, width in zip(copies, widths)))
        return _Cut(
            text="".join(parts),
            starts=starts,
            widths=widths,
            copies=copies,
            ids=[self.added[x][0] for x in tokens],
            full_ends=list(map(sum, zip(starts, widths, drops))),
            drops=drops,
        )

    def _written_out(self, pieces: RunText) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        """``pieces`` with the runs that are not cut (one copy, or a token that does not compress) made
        literal text."""
        literals, runs = [pieces.literals[0]], []
        for (x, count), literal in zip(pieces.runs, pieces.literals[1:], strict=True):
            if count > 1 and self.compressible(x):
                runs.append((x, count))
                literals.append(literal)
            else:
                literals[-1] += x * count + literal
        return tuple(literals), tuple(runs)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Cut:
    """A text with each cut run kept as its first copy; per run (in text order) where that copy starts
    in the short text, its width, copies and id, where the run ends in the whole text and the
    characters dropped up to there.

    A short-text position ``p`` is the whole text's ``p + d``, ``d`` the characters dropped by the
    runs whose kept copy ends at or before ``p``: strictly increasing, so a span maps back exactly."""

    text: str
    starts: list[int]  # strictly increasing: the runs do not overlap
    widths: list[int]
    copies: list[int]
    ids: list[int]
    full_ends: list[int]  # the whole text's end of each run
    drops: list[int]  # characters dropped by the runs up to and including this one

    def kept(self, ids: list[int], starts: list[int], ends: list[int]) -> list[int] | None:
        """The short text's token of each run's copy (in run order), or None where a copy is not exactly
        one token of its own offsets and id (then the whole text is tokenized as it is).

        ``starts`` and ends never decrease, so the tokens starting where a copy starts are adjacent."""
        hits = []
        lo, n = 0, len(starts)
        for start, width, token in zip(self.starts, self.widths, self.ids, strict=True):
            i = bisect.bisect_left(starts, start, lo)
            found = -1
            while i < n and starts[i] == start:
                if ends[i] == start + width:
                    if found >= 0:
                        return None
                    found = i
                i += 1
            if found < 0 or ids[found] != token:
                return None
            hits.append(found)
            lo = i
        return hits

    def short(self, spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
        """Whole-text spans as short-text spans that a short-text token overlaps exactly when its
        whole-text offsets overlap the span: ``[a, b)`` -> ``[last(a), last(b - 1) + 1)``."""
        return [(self._last(a), self._last(b - 1) + 1) for a, b in spans]

    def _last(self, pos: int) -> int:
        """The last short-text position at or before the whole text's ``pos`` (a dropped copy's
        position: the kept copy's last character)."""
        r = bisect.bisect_right(self.full_ends, pos)  # runs that end by pos
        short = pos - (self.drops[r - 1] if r else 0)
        if r < len(self.starts):
            short = min(short, self.starts[r] + self.widths[r] - 1)
        return short

    def expand(self, ids: list[int], mask: bytearray, hits: list[int]) -> tuple[list[int], npt.NDArray[np.uint8]]:
        """``ids`` with each run's kept copy (``hits``) repeated, and ``mask`` with every copy 0 (it lies
        in a media span): a slice and a repeat per run, in C."""
        out: list[int] = []
        out_mask: list[bytes | bytearray] = []
        prev = 0
        for hit, token, count in zip(hits, self.ids, self.copies, strict=True):
            out += ids[prev:hit]
            out += [token] * count
            out_mask += (mask[prev:hit], bytes(count))
            prev = hit + 1
        out += ids[prev:]
        out_mask.append(mask[prev:])
        return out, np.frombuffer(bytearray().join(out_mask), dtype=np.uint8)
