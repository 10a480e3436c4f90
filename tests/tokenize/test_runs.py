"""Declared runs of one added token tokenized once give the tokenizer's own ids and mask.

Oracle: the tokenizer called on the whole text (``tokenizer(text, return_offsets_mapping=True)``)
and the overlap rule on its offsets, for the Gemma 3 and Idefics3 example tokenizers, with
expansions declared as pieces and runs (`RunText`) placed in many contexts (text start and end,
spaces and newlines either side, images side by side, runs of different lengths through one
encoder). Tokens that overlap another added token, or carry strip / single-word rules, are never
compressed (their runs are written out), and the result is the same; where the short text's
tokens fail the check, the whole text is tokenized.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import AddedToken

from families.processor import load_processor
from families.registry import example_family
from families.run_text import RunText
from prep.tokenize.expansion import ExpandedText
from prep.tokenize.runs import RunEncoder, _Cut
from tests.tokenize.run_truth import check, place, truth


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    return load_processor(str(example_family("gemma3").build_processor(tmp_path_factory.mktemp("g3") / "p"))).tokenizer


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory):
    path = example_family("idefics3").build_processor(tmp_path_factory.mktemp("id3") / "p")
    return load_processor(str(path)).tokenizer


def _texts(seed: int, expansions: list[RunText]) -> list[ExpandedText]:
    """Expansions between random pieces of text, as `expand_placeholders` places them."""
    rng = random.Random(seed)
    pieces = ["", " ", "\n", "\n\n", "Look:", "a cat ", "x", "  two  spaces", "<start_of_turn>user\n", "!\n"]
    out = []
    for _ in range(30):
        chosen = [rng.choice(expansions) for _ in range(rng.randint(1, 3))]
        out.append(place(chosen, [rng.choice(pieces) for _ in range(len(chosen) + 1)]))
    return out


def _check(tok, encoder: RunEncoder, expansions: list[RunText], seed: int) -> int:
    """Texts whose short text alone was tokenized (runs cut and kept), both ways of adding specials."""
    compressed = 0
    for expanded in _texts(seed, expansions):
        compressed += sum(check(tok, encoder, expanded, add_special) for add_special in (False, True)) // 2
    return compressed


def test_gemma3_image_runs_tokenize_as_the_whole_text(gemma3):
    soft, boi, eoi = "<image_soft_token>", "<start_of_image>", "<end_of_image>"
    full = RunText.of([f"\n\n{boi}", (soft, 256), f"{eoi}\n\n"])
    short = RunText.of([f"\n\n{boi}", (soft, 3), f"{eoi}\n\n"])
    crops = RunText.of(
        ["Here is the original image ", full, " and here are some crops to help you see better ", full, " ", full]
    )
    assert (
        crops.text == f"Here is the original image {full} and here are some crops to help you see better {full} {full}"
    )
    encoder = RunEncoder(gemma3)
    assert encoder.compressible(soft)
    assert _check(gemma3, encoder, [full, short, crops], seed=0) == 30  # every text's runs were cut and kept


def test_idefics3_tile_runs_tokenize_as_the_whole_text(idefics3):
    image, fake = "<image>", "<fake_token_around_image>"
    expansions = [
        RunText.of(
            [f"{fake}<row_1_col_1>", (image, 9), f"{fake}<row_1_col_2>", (image, 9), "\n\n"]
            + [f"{fake}<global-img>", (image, 9), fake]
        ),
        RunText.of([fake, (image, 4), fake]),
    ]
    encoder = RunEncoder(idefics3)
    assert _check(idefics3, encoder, expansions, seed=1) > 0


def test_overlapping_or_stripping_tokens_are_never_compressed(gemma3):
    """Tokens whose runs could tokenize otherwise: their runs are written out, ids as the tokenizer."""
    tok = gemma3.__class__.from_pretrained(gemma3.name_or_path)
    tok.add_tokens([AddedToken("<zz>", normalized=False), AddedToken("z><z", normalized=False)])  # partial overlap
    tok.add_tokens([AddedToken("<qq>", normalized=False, rstrip=True)])
    tok.add_tokens([AddedToken("ab", normalized=False), AddedToken("abab!", normalized=False)])  # contained
    encoder = RunEncoder(tok)
    for token in ("<zz>", "z><z", "<qq>", "ab"):
        assert not encoder.compressible(token), token
    soft = "<image_soft_token>"
    expansions = [
        RunText.of([("<zz>", 5), (soft, 3)]),
        RunText.of([("<qq>", 4), " ", (soft, 2), "x"]),
        RunText.of(["!", ("ab", 6), "!"]),
        RunText.of([(soft, 7)]),
        RunText.of([("ab", 3), (soft, 4), ("<zz>", 2)]),
    ]
    assert _check(tok, encoder, expansions, seed=2) > 0  # the soft-token runs still compress
    cut = encoder._cut(RunText.of([("<zz>", 5), (soft, 3), ("ab", 6)]))
    assert cut.text == "<zz>" * 5 + soft + "ab" * 6 and cut.copies == [3]  # the others written out


def test_runs_at_either_end_of_the_text(gemma3):
    """A run that opens or closes the whole text (no literal before or after it), runs side by side."""
    soft, boi = "<image_soft_token>", "<start_of_image>"
    encoder = RunEncoder(gemma3)
    for expansion, pieces in (
        (RunText.of([(soft, 5)]), ["", ""]),
        (RunText.of([(soft, 5), "a"]), ["", "b"]),
        (RunText.of(["a", (soft, 2)]), ["\n\n", ""]),
        (RunText.of([(soft, 2), (boi, 3), (soft, 4)]), ["", ""]),
    ):
        for add_special in (False, True):
            assert check(gemma3, encoder, place([expansion], pieces), add_special)


def test_split_special_tokens_tokenizes_the_text_whole(gemma3):
    tok = gemma3.__class__.from_pretrained(gemma3.name_or_path, split_special_tokens=True)
    encoder = RunEncoder(tok)
    expanded = place([RunText.of([("<image_soft_token>", 5)])], ["Look:", "!"])
    assert not check(tok, encoder, expanded, add_special=False)
    ids, _ = encoder.encode_masked(expanded, False)
    assert np.asarray(ids).size > 5 and ids == truth(tok, expanded.text, False)[0]


def test_a_copy_that_is_not_one_token_of_its_own_is_not_kept():
    """`_Cut.kept` on doctored tokens: the copy split, doubled, of another id or missing."""
    cut = _Cut(
        text="ab<s>c<s>", starts=[2, 6], widths=[3, 3], copies=[4, 2], ids=[9, 9], full_ends=[14, 20], drops=[9, 12]
    )
    starts, ends, ids = [0, 2, 5, 6], [2, 5, 6, 9], [1, 9, 2, 9]
    assert cut.kept(ids, starts, ends) == [1, 3]
    assert cut.kept([1, 9, 2, 8], starts, ends) is None  # another id
    assert cut.kept([1, 9, 9, 2, 9], [0, 2, 3, 5, 6], [2, 3, 5, 6, 9]) is None  # split in two
    assert cut.kept([1, 9, 9, 2, 9], [0, 2, 2, 5, 6], [2, 5, 5, 6, 9]) is None  # two tokens of its offsets
    assert cut.kept([1, 9, 2], [0, 2, 5], [2, 5, 9]) is None  # merged with what follows


def test_the_whole_text_is_tokenized_where_the_check_fails(gemma3, monkeypatch: pytest.MonkeyPatch):
    """A failed check (forced here) and offsets that decrease (an end token at (0, 0)): the whole text."""
    soft = "<image_soft_token>"
    expanded = place([RunText.of(["\n\n", (soft, 6), "\n\n"])], ["Look:", "Cat"], [(2, 40)])
    encoder = RunEncoder(gemma3)
    assert check(gemma3, encoder, expanded, add_special=False)
    monkeypatch.setattr(_Cut, "kept", lambda *_: None)
    assert not check(gemma3, encoder, expanded, add_special=False)
    monkeypatch.undo()

    from tokenizers.processors import TemplateProcessing

    tok = gemma3.__class__.from_pretrained(gemma3.name_or_path)
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tok.convert_tokens_to_ids(eos))]
    )
    assert truth(tok, "ab", True)[1][-1] == [0, 0]  # the appended token's offsets go back to 0
    assert not check(tok, RunEncoder(tok), expanded, add_special=True)
    assert check(tok, RunEncoder(tok), expanded, add_special=False)
