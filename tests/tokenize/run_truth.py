"""The truth the RunEncoder tests compare with: the tokenizer's own call on the whole text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import prep.tokenize.runs as runs_module
from families.run_text import RunText
from prep.tokenize.expansion import ExpandedText
from prep.tokenize.runs import RunEncoder


def truth(tok: Any, text: str, add_special: bool) -> tuple[list[int], list[list[int]]]:
    """Ids and offsets of ``text`` from ``tok(...)``, with every run written out."""
    enc = tok(text, add_special_tokens=add_special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [list(o) for o in enc["offset_mapping"]]


def place(expansions: list[RunText], pieces: list[str], spans: list[tuple[int, int]] | None = None) -> ExpandedText:
    """``pieces[0] + e0 + pieces[1] + e1 + ...``, the media spans where the expansions sit."""
    parts: list[str | RunText] = [pieces[0]]
    media, at = [], len(pieces[0])
    for e, after in zip(expansions, pieces[1:], strict=True):
        media.append((at, at + e.num_chars))
        parts += [e, after]
        at += e.num_chars + len(after)
    return ExpandedText(pieces=RunText.of(parts), assistant_spans=spans or [], media_spans=tuple(media))


def mask_truth(offsets: list[list[int]], spans: list[tuple[int, int]], media: tuple[tuple[int, int], ...]) -> list[int]:
    """The overlap rule on the whole text's offsets (every token against every span)."""
    if not offsets:
        return []
    a, b = np.asarray(offsets).T
    inside = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        inside |= (a < e) & (b > s)
    for s, e in media:
        inside &= ~((a < e) & (b > s))
    return inside.astype(int).tolist()


def span_sets(expanded: ExpandedText) -> list[list[tuple[int, int]]]:
    """Assistant spans around, inside and across the media spans, ending on either side of each run, and
    the text's own."""
    n, media = expanded.pieces.num_chars, expanded.media_spans
    edges, at = [], 0  # where each run starts and ends in the whole text
    for literal, (token, copies) in zip(expanded.pieces.literals, expanded.pieces.runs, strict=False):
        at += len(literal)
        edges += [at, at + len(token), at + len(token) * copies]
        at += len(token) * copies
    around = [(max(e - 1, 0), e + 1) for e in edges] + [(e, e) for e in edges]
    fixed = [[], [(0, n)], [(0, n // 3), (n // 2, n)], [(a + 1, b + 2) for a, b in media], [(n // 4, n // 4 + 1)]]
    return [*fixed, around, expanded.assistant_spans]


@contextmanager
def encoded_texts() -> Iterator[list[str]]:
    """The texts `RunEncoder` hands the tokenizer while inside."""
    seen: list[str] = []
    real = runs_module.encode_pairs

    def spy(tokenizer: Any, text: str, add_special_tokens: bool) -> Any:
        seen.append(text)
        return real(tokenizer, text, add_special_tokens)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs_module, "encode_pairs", spy)
        yield seen


def check(tok: Any, encoder: RunEncoder, expanded: ExpandedText, add_special: bool) -> bool:
    """``encode_masked``'s ids and mask against the tokenizer on the whole text, for many assistant spans;
    True where the short text alone was tokenized (the runs were cut and kept)."""
    text = expanded.text
    ids_truth, offsets = truth(tok, text, add_special)
    whole = []
    for spans in span_sets(expanded):
        case = ExpandedText(pieces=expanded.pieces, assistant_spans=spans, media_spans=expanded.media_spans)
        with encoded_texts() as seen:
            ids, mask = encoder.encode_masked(case, add_special)
        assert ids == ids_truth, text[:200]
        assert mask.dtype == np.uint8 and mask.tolist() == mask_truth(offsets, spans, case.media_spans), (
            spans,
            text[:200],
        )
        whole.append(text in seen)
    assert len(set(whole)) == 1  # the spans never decide the path
    return not whole[0]
