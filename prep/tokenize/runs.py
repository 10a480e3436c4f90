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
from typing import Any

import numpy as np
import numpy.typing as npt

Run = tuple[int, int, str, int]  # start, end in the expansion text, the token, copies


def _overlaps(a: str, b: str) -> bool:
    """A proper suffix of ``a`` is a prefix of ``b``."""
    return any(a[-k:] == b[:k] for k in range(1, min(len(a), len(b))))


class RunEncoder:
    """Per worker: which added tokens compress, and the runs of each distinct expansion text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.added = {token.content: (token_id, token) for token_id, token in added.items()}
        self.eligible: dict[str, bool] = {}
        self.runs: dict[str, tuple[Run, ...]] = {}

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
        if expansion not in self.runs:
            found: list[Run] = []
            for x in self.added:
                if x + x in expansion and self.compressible(x):
                    found.extend(
                        (m.start(), m.end(), x, (m.end() - m.start()) // len(x))
                        for m in re.finditer(f"(?:{re.escape(x)}){{2,}}", expansion)
                    )
            self.runs[expansion] = tuple(sorted(found))
        return self.runs[expansion]

    def encode(
        self, text: str, media_spans: tuple[tuple[int, int], ...], add_special_tokens: bool
    ) -> tuple[list[int], npt.NDArray[np.int64]]:
        """Ids and character offsets (n, 2) of ``text``, as ``tokenizer(text, return_offsets_mapping=True)``."""
        runs = [] if getattr(self.tokenizer, "split_special_tokens", False) else self._absolute_runs(text, media_spans)
        if not runs:
            return self._plain(text, add_special_tokens)
        pieces, prev, drop = [], 0, 0
        starts, removed, copies, widths, ids = [], [], [], [], []
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
        short_ids, short_offsets = self._plain("".join(pieces), add_special_tokens)
        expanded = self._expand(short_ids, short_offsets, starts, removed, copies, widths, ids)
        return expanded if expanded is not None else self._plain(text, add_special_tokens)

    def _absolute_runs(self, text: str, media_spans: tuple[tuple[int, int], ...]) -> list[Run]:
        runs: list[Run] = []
        for a, b in media_spans:
            runs.extend((a + s, a + e, x, k) for s, e, x, k in self.runs_in(text[a:b]))
        return sorted(runs)

    def _plain(self, text: str, add_special_tokens: bool) -> tuple[list[int], npt.NDArray[np.int64]]:
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(enc["input_ids"]), np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def _expand(
        self,
        ids: list[int],
        offsets: npt.NDArray[np.int64],
        starts: list[int],
        removed: list[int],
        copies: list[int],
        widths: list[int],
        run_ids: list[int],
    ) -> tuple[list[int], npt.NDArray[np.int64]] | None:
        """Each run's one copy back to ``copies`` ids, offsets back to the full text's; None where a
        run's copy is not one token with its own offsets (then the full text is tokenized as it is)."""
        where: dict[int, int] = {}  # short-text token index -> run
        for r, start in enumerate(starts):
            at = np.flatnonzero((offsets[:, 0] == start) & (offsets[:, 1] == start + widths[r])).tolist()
            hits = [h for h in at if ids[h] == run_ids[r]]
            if len(hits) != 1:
                return None
            where[hits[0]] = r
        shift = np.concatenate([[0], np.asarray(removed, dtype=np.int64)])
        # a position at or past a run's end in the short text moves by what that run dropped
        ends = np.asarray([s + w for s, w in zip(starts, widths, strict=True)], dtype=np.int64)
        moved = offsets + shift[np.searchsorted(ends, offsets, side="right")]
        reps = np.ones(len(ids), dtype=np.int64)
        for h, r in where.items():
            reps[h] = copies[r]
        out_offsets = np.repeat(moved, reps, axis=0)
        out_ids = np.repeat(np.asarray(ids, dtype=np.int64), reps)
        pos = np.cumsum(reps) - reps  # first output index of each short token
        for h, r in where.items():
            step = np.arange(copies[r], dtype=np.int64) * widths[r]
            first = out_offsets[pos[h], 0]
            out_offsets[pos[h] : pos[h] + copies[r], 0] = first + step
            out_offsets[pos[h] : pos[h] + copies[r], 1] = first + step + widths[r]
        return out_ids.tolist(), out_offsets
