"""The truth the RunEncoder tests compare with: the tokenizer's own call on the whole text."""

from __future__ import annotations

from typing import Any

import numpy as np

from prep.tokenize.runs import RunEncoder


def truth(tok: Any, text: str, add_special: bool) -> tuple[list[int], list[list[int]]]:
    """Ids and offsets of ``text`` from ``tok(...)``, with every run written out."""
    enc = tok(text, add_special_tokens=add_special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [list(o) for o in enc["offset_mapping"]]


def check_mask(tok: Any, encoder: RunEncoder, text: str, media: tuple[tuple[int, int], ...], add_special: bool) -> None:
    """``encode_masked`` (no offsets for the run copies) against the overlap rule on the whole text's offsets,
    for assistant spans around, inside and across the media spans."""
    ids_truth, offsets = truth(tok, text, add_special)
    n = len(text)
    for spans in ([], [(0, n)], [(0, n // 3), (n // 2, n)], [(a + 1, b + 2) for a, b in media], [(n // 4, n // 4 + 1)]):
        ids, mask = encoder.encode_masked(text, media, add_special, spans)
        inside = [any(a < e and b > s for s, e in spans) for a, b in offsets]
        expect = [int(i and not any(a < e and b > s for s, e in media)) for i, (a, b) in zip(inside, offsets)]
        assert ids == ids_truth
        assert mask.dtype == np.uint8 and mask.tolist() == expect, (spans, text[:200])
