"""Tokenize text whose media expansions repeat one added token many times, once per run.

Gemma 3 writes 256 ``<image_soft_token>`` per image into the text (Idefics3 a tile's worth of
``<image>``): the tokenizer's added-token matcher then makes one piece per copy, and a sample
with two images cost ~4 ms there alone. An added token ``X`` that is matched on the raw text
(``normalized`` false), has no ``lstrip`` / ``rstrip`` / ``single_word`` rule and overlaps no
added token (no other contains it or is contained in it, no proper suffix of one is a prefix of
the other, ``X`` included against itself) tokenizes the same in any text ``A + X * k + B`` as in
``A + X + B`` with its id repeated k times: every added-token match touching the run is then a
whole copy of ``X``, so the pieces between matches (what BPE sees) are the same in both texts.
Runs are only looked for inside the media spans (the expansions), each distinct expansion once
per worker; the offsets after a run move by the characters it dropped.

Example: ``"Look:\\n\\n<boi>" + "<soft>" * 256 + "<eoi>\\n\\nCat"`` is tokenized as
``"Look:\\n\\n<boi><soft><eoi>\\n\\nCat"``, then the ``<soft>`` id is repeated 256 times with
offsets ``(s + 6 j, s + 6 j + 6)``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from prep.tokenize.offsets import encode_offsets, overlap_mask

Run = tuple[int, int, str, int]  # start, end in the expansion text, the token, copies
MEMO_TEXTS = 256  # expansion texts whose runs a worker keeps (a Kimi K2.5 video's text: ~45 KB)


def _overlaps(a: str, b: str) -> bool:
    """A proper suffix of ``a`` is a prefix of ``b``."""
    return any(a[-k:] == b[:k] for k in range(1, min(len(a), len(b))))


def _trie(words: list[str]) -> str:
    """A regex matching exactly ``words`` (non-empty), longest first where one is a prefix of another."""
    ends = "" in words
    groups: dict[str, list[str]] = defaultdict(list)
    for word in words:
        if word:
            groups[word[0]].append(word[1:])
    parts = [re.escape(c) + _trie(rest) for c, rest in sorted(groups.items())]
    if not parts:
        return ""
    if len(parts) == 1 and not ends:
        return parts[0]
    return "(?:" + "|".join(parts) + (")?" if ends else ")")


class RunEncoder:
    """Per worker: which added tokens compress, and the runs of each distinct expansion text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.added = {token.content: (token_id, token) for token_id, token in added.items()}
        self.eligible: dict[str, bool] = {}
        self.runs: dict[str, tuple[Run, ...]] = {}  # the last MEMO_TEXTS expansion texts
        self.hot: list[str] = []  # compressible tokens seen in runs, looked for first
        self.repeats: dict[tuple[str, int], str] = {}
        self._doubles_pattern: re.Pattern[str] | None = None

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

    def runs_in(self, expansion: str) -> tuple[Run, ...]:
        """Runs of two or more copies of a compressible token in one expansion text (memoised by the text)."""
        if expansion in self.runs:
            return self.runs[expansion]
        found: list[Run] = []
        for x in self.hot:
            found.extend(self._runs_of(expansion, x, 0, len(expansion)))
        found.sort()
        # any other token's runs lie between those: one that crossed a run of x would overlap x
        gaps = [(a, b) for a, b in zip([0, *(r[1] for r in found)], [*(r[0] for r in found), len(expansion)]) if b > a]
        rest = "\0".join(expansion[a:b] for a, b in gaps)  # a match across a \0 only costs the exact look below
        for match in self._doubles().finditer(rest):
            x = match.group()[: (match.end() - match.start()) // 2]
            if x not in self.hot and self.compressible(x):
                runs = [run for a, b in gaps for run in self._runs_of(expansion, x, a, b)]
                if runs:
                    self.hot.append(x)
                    found.extend(runs)
        if len(self.runs) >= MEMO_TEXTS:  # a video's expansion text differs with its length: keep the newest
            del self.runs[next(iter(self.runs))]
        self.runs[expansion] = tuple(sorted(found))
        return self.runs[expansion]

    def _runs_of(self, text: str, x: str, lo: int, hi: int) -> list[Run]:
        """Maximal runs of two or more copies of ``x`` inside ``text[lo:hi]``, left to right.

        Found with ``str.find`` of ``x + x`` and copies counted by galloping ``startswith`` over
        ``x * 2^j``: a few C-level compares per run, not one regex step per character (a Kimi K2.5
        chunk holds hundreds of copies). ``x`` never overlaps itself, so runs are where the
        regex ``(?:x){2,}`` matches."""
        width, out = len(x), []
        guess, copies = "", 0  # the previous run, ``x * copies``: video runs are mostly of one length
        at = text.find(x + x, lo, hi)
        while at != -1:
            if copies and text.startswith(guess, at, hi) and not text.startswith(x, at + len(guess), hi):
                end = at + len(guess)
            else:
                end = at + 2 * width
                step = 1  # copies known to follow at end: gallop up, then halve down
                while text.startswith(self._repeat(x, step), end, hi):
                    end += step * width
                    step *= 2
                while step > 1:
                    step //= 2
                    if text.startswith(self._repeat(x, step), end, hi):
                        end += step * width
                if (end - at) // width != copies:
                    copies = (end - at) // width
                    guess = x * copies
            out.append((at, end, x, copies))
            at = text.find(x + x, end, hi)
        return out

    def _doubles(self) -> re.Pattern[str]:
        """Matches ``x + x`` for every added token ``x``: one C-level pass finds the tokens that may form
        runs (a Python loop of ``x + x in text`` over Gemma 4's 117 added tokens cost ~75 us a text).

        A compressible ``x``'s doubles are all matched: a match of another ``y + y`` that started at or
        inside one would make ``x`` and ``y`` overlap. The alternatives form a trie (one branch per
        first character at each level), which ``re`` skips by its first literal."""
        if self._doubles_pattern is None:
            self._doubles_pattern = re.compile(_trie([x + x for x in self.added if x]))
        return self._doubles_pattern

    def _repeat(self, x: str, copies: int) -> str:
        """``x * copies`` for powers of two, kept per token (the galloping compares of `_runs_of`)."""
        key = (x, copies)
        if key not in self.repeats:
            self.repeats[key] = x * copies
        return self.repeats[key]

    def encode(
        self, text: str, media_spans: tuple[tuple[int, int], ...], add_special_tokens: bool
    ) -> tuple[list[int], npt.NDArray[np.int64]]:
        """Ids and character offsets (n, 2) of ``text``, as ``tokenizer(text, return_offsets_mapping=True)``."""
        cut = self._cut(text, media_spans)
        if cut is not None:
            ids, offsets = self._plain(cut.text, add_special_tokens)
            hits = cut.kept(ids, offsets)
            if hits is not None:
                return _expand_ids(ids, hits, cut), cut.expand_offsets(offsets, hits)
        return self._plain(text, add_special_tokens)

    def encode_masked(
        self,
        text: str,
        media_spans: tuple[tuple[int, int], ...],
        add_special_tokens: bool,
        spans: list[tuple[int, int]],
    ) -> tuple[list[int], npt.NDArray[np.uint8]]:
        """:meth:`encode`'s ids and the loss mask of its offsets (:func:`~prep.tokenize.offsets.overlap_mask`),
        without the offsets of the run copies: every copy lies inside a media span, so its mask is 0
        whatever ``spans`` are, and the kept copy's 0 is repeated (expanding the copies' offsets cost
        0.07-0.11 ms CPU a video sample, Gemma 4 and Kimi K2.5, to say only that)."""
        cut = self._cut(text, media_spans)
        if cut is not None:
            ids, offsets = self._plain(cut.text, add_special_tokens)
            hits = cut.kept(ids, offsets)
            if hits is not None:
                mask = overlap_mask(cut.moved(offsets), spans, media_spans)
                reps = np.ones(len(ids), dtype=np.int64)
                reps[hits] = cut.copies
                return _expand_ids(ids, hits, cut), np.repeat(mask, reps)
        ids, offsets = self._plain(text, add_special_tokens)
        return ids, overlap_mask(offsets, spans, media_spans)

    def _cut(self, text: str, media_spans: tuple[tuple[int, int], ...]) -> _Cut | None:
        """``text`` with each run cut to its first copy, or None where nothing is cut."""
        if getattr(self.tokenizer, "split_special_tokens", False):
            return None
        runs = self._absolute_runs(text, media_spans)
        if not runs:
            return None
        pieces, prev, drop = [], 0, 0
        starts, removed, copies, widths, ids = [], [0], [], [], []
        for start, end, x, count in runs:
            pieces.append(text[prev : start + len(x)])
            starts.append(start - drop)  # the kept copy's start in the short text
            drop += end - start - len(x)
            removed.append(drop)
            copies.append(count)
            widths.append(len(x))
            ids.append(self.added[x][0])
            prev = end
        pieces.append(text[prev:])
        return _Cut(
            text="".join(pieces),
            starts=np.asarray(starts, dtype=np.int64),
            widths=np.asarray(widths, dtype=np.int64),
            copies=np.asarray(copies, dtype=np.int64),
            shift=np.asarray(removed, dtype=np.int64),
            ids=ids,
            counts=copies,
        )

    def _absolute_runs(self, text: str, media_spans: tuple[tuple[int, int], ...]) -> list[Run]:
        runs: list[Run] = []
        for a, b in media_spans:
            runs.extend((a + s, a + e, x, k) for s, e, x, k in self.runs_in(text[a:b]))
        return sorted(runs)

    def _plain(self, text: str, add_special_tokens: bool) -> tuple[list[int], npt.NDArray[np.int64]]:
        return encode_offsets(self.tokenizer, text, add_special_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Cut:
    """A text with each run cut to its first copy; per run (in text order) where that copy starts
    in the short text, its width, copies, id; ``shift[r]``: characters dropped by runs before r."""

    text: str
    starts: npt.NDArray[np.int64]  # strictly increasing: the runs do not overlap
    widths: npt.NDArray[np.int64]
    copies: npt.NDArray[np.int64]
    shift: npt.NDArray[np.int64]  # len(runs) + 1, from 0
    ids: list[int]
    counts: list[int]  # copies, as ints

    def kept(self, ids: list[int], offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.intp] | None:
        """The short text's token of each run's copy (in run order), or None where a copy is not one token
        of its own offsets and id (then the full text is tokenized as it is).

        Whole-array steps, not one per run: a video expands to a run per frame (Gemma 4: 32) or per
        chunk (Kimi K2.5), and a loop over runs that scans every token made the runs cost more than
        the tokenizer call they save."""
        # the one run a token can be the kept copy of: the run starting where the token starts
        run = np.minimum(np.searchsorted(self.starts, offsets[:, 0]), len(self.starts) - 1)
        at = (self.starts[run] == offsets[:, 0]) & (offsets[:, 1] == offsets[:, 0] + self.widths[run])
        hits = np.flatnonzero(at)  # short-text token indices, in run order
        if not np.array_equal(run[hits], np.arange(len(self.starts))):  # each run's copy exactly once
            return None
        if any(ids[h] != x for h, x in zip(hits.tolist(), self.ids)):
            return None
        return hits

    def moved(self, offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Short-text offsets as the full text's: a position at or past a run's end moves by what it dropped."""
        return offsets + self.shift[np.searchsorted(self.starts + self.widths, offsets, side="right")]

    def expand_offsets(self, offsets: npt.NDArray[np.int64], hits: npt.NDArray[np.intp]) -> npt.NDArray[np.int64]:
        """The full text's offsets: each kept copy's row repeated ``copies`` times, one copy's width apart."""
        reps = np.ones(len(offsets), dtype=np.int64)
        reps[hits] = self.copies
        out = np.repeat(self.moved(offsets), reps, axis=0)
        first = (np.cumsum(reps) - reps)[hits]  # each run's first output index
        step = np.arange(int(self.copies.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(self.copies) - self.copies, self.copies
        )
        rows = np.repeat(first, self.copies) + step
        width = np.repeat(self.widths, self.copies)
        begin = np.repeat(out[first, 0], self.copies) + step * width
        out[rows, 0] = begin
        out[rows, 1] = begin + width
        return out


def _expand_ids(ids: list[int], hits: npt.NDArray[np.intp], cut: _Cut) -> list[int]:
    """``ids`` with each run's kept copy (``hits``) repeated: a slice and a repeat per run, in C."""
    out: list[int] = []
    prev = 0
    for hit, token, count in zip(hits.tolist(), cut.ids, cut.counts):
        out += ids[prev:hit]
        out += [token] * count
        prev = hit + 1
    out += ids[prev:]
    return out
