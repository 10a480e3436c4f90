"""Runs of one added token tokenized once give the tokenizer's own ids and offsets.

Oracle: the tokenizer called on the whole text (``tokenizer(text, return_offsets_mapping=True)``),
for the Gemma 3 and Idefics3 example tokenizers, with the expansions of their counters placed in
many contexts (text start and end, spaces and newlines either side, images side by side, runs of
different lengths through one encoder, whose memo is keyed by the expansion text). Tokens that
overlap another added token, or carry strip / single-word rules, are never compressed, and the
result is the same.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import AddedToken

from families.processor import load_processor
from families.registry import example_family
from prep.tokenize.runs import RunEncoder
from tests.tokenize.run_truth import check_mask, truth


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    return load_processor(str(example_family("gemma3").build_processor(tmp_path_factory.mktemp("g3") / "p"))).tokenizer


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory):
    path = example_family("idefics3").build_processor(tmp_path_factory.mktemp("id3") / "p")
    return load_processor(str(path)).tokenizer


def _texts(seed: int, expansions: list[str]) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Expansions between random pieces of text; the media spans where they sit."""
    rng = random.Random(seed)
    pieces = ["", " ", "\n", "\n\n", "Look:", "a cat ", "x", "  two  spaces", "<start_of_turn>user\n", "!\n"]
    out = []
    for _ in range(30):
        text, spans = rng.choice(pieces), []
        for _ in range(rng.randint(1, 3)):
            e = rng.choice(expansions)
            spans.append((len(text), len(text) + len(e)))
            text += e + rng.choice(pieces)
        out.append((text, tuple(spans)))
    return out


def _check(tok, encoder: RunEncoder, expansions: list[str], seed: int) -> int:
    compressed = 0
    for text, spans in _texts(seed, expansions):
        for add_special in (False, True):
            ids, offsets = encoder.encode(text, spans, add_special)
            assert (ids, offsets.tolist()) == truth(tok, text, add_special), text
            check_mask(tok, encoder, text, spans, add_special)
        compressed += bool(encoder._absolute_runs(text, spans))
    return compressed


def test_gemma3_image_runs_tokenize_as_the_whole_text(gemma3):
    soft, boi, eoi = "<image_soft_token>", "<start_of_image>", "<end_of_image>"
    full = f"\n\n{boi}{soft * 256}{eoi}\n\n"
    short = f"\n\n{boi}{soft * 3}{eoi}\n\n"
    crops = f"Here is the original image {full} and here are some crops to help you see better {full} {full}"
    encoder = RunEncoder(gemma3)
    assert encoder.compressible(soft)
    assert _check(gemma3, encoder, [full, short, crops], seed=0) == 30  # every text had a run to compress
    assert len(encoder.runs) == 3  # one memo entry per distinct expansion


def test_idefics3_tile_runs_tokenize_as_the_whole_text(idefics3):
    image, fake = "<image>", "<fake_token_around_image>"
    tile = f"{fake}<row_1_col_1>{image * 9}"
    expansions = [
        f"{tile}{fake}<row_1_col_2>{image * 9}\n\n{fake}<global-img>{image * 9}{fake}",
        f"{fake}{image * 4}{fake}",
    ]
    encoder = RunEncoder(idefics3)
    assert _check(idefics3, encoder, expansions, seed=1) > 0


def test_overlapping_or_stripping_tokens_are_never_compressed(gemma3):
    """Tokens whose runs could tokenize otherwise: the encoder tokenizes them whole, ids as the tokenizer."""
    tok = gemma3.__class__.from_pretrained(gemma3.name_or_path)
    tok.add_tokens([AddedToken("<zz>", normalized=False), AddedToken("z><z", normalized=False)])  # partial overlap
    tok.add_tokens([AddedToken("<qq>", normalized=False, rstrip=True)])
    tok.add_tokens([AddedToken("ab", normalized=False), AddedToken("abab!", normalized=False)])  # contained
    encoder = RunEncoder(tok)
    for token in ("<zz>", "z><z", "<qq>", "ab"):
        assert not encoder.compressible(token), token
    expansions = ["<zz>" * 5, "<qq>" * 4 + " ", "ab" * 6 + "!", "<image_soft_token>" * 7]
    assert _check(tok, encoder, expansions, seed=2) > 0  # the soft-token runs still compress


def test_split_special_tokens_tokenizes_the_text_whole(gemma3):
    tok = gemma3.__class__.from_pretrained(gemma3.name_or_path, split_special_tokens=True)
    encoder = RunEncoder(tok)
    text = "Look:" + "<image_soft_token>" * 5 + "!"
    ids, offsets = encoder.encode(text, ((5, len(text) - 1),), False)
    assert (ids, offsets.tolist()) == truth(tok, text, False)
    assert np.asarray(ids).size > 5
