"""Rendered text -> ids, offsets and loss mask through the backend equal the tokenizer's ``__call__``.

Oracles: ``tokenizer(text, add_special_tokens=..., return_offsets_mapping=True)`` (transformers'
whole path) for every example family's tokenizer on hypothesis texts (the family's added tokens
alone and in runs, unicode that NFC changes, byte-fallback characters, whitespace, the BOS at
the start or not, with and without special tokens), and a per-token Python loop of the overlap
rule for the mask over random spans (post-processor tokens with empty offsets included). Classes
or states for which the call is not the backend's encode (an override on the way, truncation,
split special tokens) take the call and give its ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from families.processor import load_processor
from families.registry import example_families, example_family
from prep.tokenize.encode import tokenize_rendered
from prep.tokenize.offsets import direct_backend, encode_offsets, pairs_mask
from prep.tokenize.template import RenderedText

FAMILIES = example_families()
PLAIN = ["", " ", "  ", "\n", "\n\n", "\t", "Hello", " world", "a cat.", "00:01", "ß", "e\u0301", "\u00e9", "Å"]
PLAIN += ["中文", "🙂", "\u200b", "x" * 40, "ﬁ", "\r\n", "ǅ", "\U0001f3f3\ufe0f\u200d\U0001f308"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("encode")
    return {f: load_processor(str(example_family(f).build_processor(Path(root) / f))).tokenizer for f in FAMILIES}


def _truth(tok: Any, text: str, add_special: bool) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tok(text, add_special_tokens=add_special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _text(data: st.DataObject, tok: Any) -> str:
    added = sorted(tok.get_added_vocab())
    piece = st.one_of(
        st.sampled_from(PLAIN),
        st.tuples(st.sampled_from(added), st.integers(1, 5)).map(lambda tc: tc[0] * tc[1]),
        st.text(max_size=6),
    )
    text = "".join(data.draw(st.lists(piece, max_size=10)))
    if tok.bos_token is not None and data.draw(st.booleans()):
        text = tok.bos_token + text
    return text


def test_every_example_tokenizer_takes_the_backend(tokenizers):
    """The example families' tokenizers are plain TokenizersBackend classes: the fast path serves them."""
    assert {f for f, tok in tokenizers.items() if direct_backend(tok) is None} == set()


# by index, not name: only the tokenizer is used, which loads without torchvision (conftest would
# skip a case named after a torchvision-only family)
@pytest.mark.parametrize("index", range(len(FAMILIES)), ids=FAMILIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ids_offsets_and_mask_equal_the_call(tokenizers, index, data):
    tok = tokenizers[FAMILIES[index]]
    text = _text(data, tok)
    add_special = data.draw(st.booleans())
    ids, offsets = encode_offsets(tok, text, add_special)
    truth_ids, truth_offsets = _truth(tok, text, add_special)
    assert ids == truth_ids
    assert offsets.dtype == np.int64 and offsets.shape == (len(ids), 2)
    assert [tuple(o) for o in offsets.tolist()] == truth_offsets

    cut = st.integers(0, len(text))
    spans = [tuple(sorted(data.draw(st.tuples(cut, cut)))) for _ in range(data.draw(st.integers(0, 3)))]
    media = tuple(tuple(sorted(data.draw(st.tuples(cut, cut)))) for _ in range(data.draw(st.integers(0, 2))))
    rendered = RenderedText(text=text, assistant_spans=spans, media_spans=media)  # type: ignore[arg-type]
    got = tokenize_rendered(tok, rendered)
    bos = tok.bos_token
    expect_ids, expect_offsets = _truth(tok, text, not (bos is not None and text.startswith(bos)))
    expect = [
        int(any(a < e and b > s for s, e in spans) and not any(a < e and b > s for s, e in media))
        for a, b in expect_offsets
    ]
    assert got.input_ids == expect_ids
    assert got.loss_mask.dtype == np.uint8 and got.loss_mask.tolist() == expect


def test_overrides_and_other_states_take_the_call(tokenizers):
    tok = tokenizers["qwen2_vl"]
    text = "<|im_start|>user\nHi there, a long enough text<|im_end|>"
    truth = _truth(tok, text, False)

    class Custom(type(tok)):  # type: ignore[misc]
        def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
            return super()._encode_plus(*args, **kwargs)

    custom = Custom.from_pretrained(tok.name_or_path)
    assert direct_backend(custom) is None
    assert _pairs(encode_offsets(custom, text, False)) == truth

    truncating = type(tok).from_pretrained(tok.name_or_path)
    truncating.backend_tokenizer.enable_truncation(max_length=3)  # __call__ turns it off again
    assert direct_backend(truncating) is None
    assert _pairs(encode_offsets(truncating, text, False)) == truth
    assert direct_backend(truncating) is not None  # the call reset the backend: the next one is direct

    stale = type(tok).from_pretrained(tok.name_or_path)
    stale.backend_tokenizer.encode_special_tokens = True  # not what split_special_tokens (False) says
    assert direct_backend(stale) is None
    assert _pairs(encode_offsets(stale, text, False)) == truth

    split = type(tok).from_pretrained(tok.name_or_path, split_special_tokens=True)  # the backend set at load
    assert direct_backend(split) is not None
    assert _pairs(encode_offsets(split, text, False)) == _truth(split, text, False) != truth


def _pairs(result: tuple[list[int], Any]) -> tuple[list[int], list[tuple[int, int]]]:
    return result[0], [tuple(o) for o in result[1].tolist()]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_pairs_mask_is_the_overlap_rule_for_any_offsets(data):
    """Monotone offsets (the bisection), empty ones, and out-of-order ones (a trailing (0, 0) EOS, shuffles)."""
    n = data.draw(st.integers(0, 30))
    bounds = sorted(data.draw(st.lists(st.integers(0, 60), min_size=2 * n, max_size=2 * n)))
    pairs = [(bounds[2 * i], bounds[2 * i + 1]) for i in range(n)]
    if data.draw(st.booleans()):
        pairs = data.draw(st.permutations(pairs)) + data.draw(st.lists(st.just((0, 0)), max_size=2))
    cut = st.integers(0, 61)
    spans = [tuple(sorted(data.draw(st.tuples(cut, cut)))) for _ in range(data.draw(st.integers(0, 3)))]
    media = tuple(tuple(sorted(data.draw(st.tuples(cut, cut)))) for _ in range(data.draw(st.integers(0, 2))))
    got = pairs_mask(pairs, spans, media)  # type: ignore[arg-type]
    inside = [any(a < e and b > s for s, e in spans) for a, b in pairs]
    expect = [int(i and not any(a < e and b > s for s, e in media)) for i, (a, b) in zip(inside, pairs)]
    assert got.dtype == np.uint8 and got.tolist() == expect
