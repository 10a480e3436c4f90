"""Text-level media expansion: the text, spans and mask against ``str.replace`` and offsets."""

from __future__ import annotations

import random

import numpy as np
import pytest

from families.qwen2_vl.processor_dir import build_processor_dir
from families.run_text import RunText
from packvlm.sample_error import SampleError
from prep.tokenize.encode import tokenize_rendered
from prep.tokenize.expansion import ExpandedText, expand_placeholders
from prep.tokenize.template import RenderedText
from schemas.reasons import Reason

TOKEN = "<|image_pad|>"


def _spans_text(text: str, spans: list[tuple[int, int]]) -> list[str]:
    return [text[a:b] for a, b in spans]


@pytest.mark.parametrize("seed", range(20))
def test_expansion_equals_sequential_replace_and_moves_spans(seed: int) -> None:
    rng = random.Random(seed)
    parts = [rng.choice(["ab", " x\n", "\n\n", "", "cat dog"]) for _ in range(8)]
    text = TOKEN.join(parts)
    n = len(parts) - 1
    choices = [["\n\n<E>\n\n"], [""], ["zz"], [(TOKEN, 2)], [("<E>", 3), "\n", ("<E>", 2)], ["a", ("zz", 4)]]
    runs = [RunText.of(rng.choice(choices)) for _ in range(n)]  # literal text and declared runs
    expansions = [e.text for e in runs]
    # assistant spans: random non-overlapping [a, b) that never cut a placeholder in half
    cuts = sorted({0, len(text), *(i for i in range(len(text)) if not _inside_token(text, i))})
    picks = sorted(rng.sample(cuts, 4))
    spans = [(picks[0], picks[1]), (picks[2], picks[3])]
    out = expand_placeholders(RenderedText(text=text, assistant_spans=spans), TOKEN, runs, "image")

    expected = text
    for e in expansions:  # what the processors do: one replace per item, left to right
        expected = expected.replace(TOKEN, "\0" + e.replace(TOKEN, "\1") + "\2", 1)
    assert out.text == expected.replace("\0", "").replace("\1", TOKEN).replace("\2", "")
    # each assistant span holds the same text, with its own placeholders expanded
    for (a, b), (na, nb) in zip(spans, out.assistant_spans, strict=True):
        inner = text[a:b]
        k = text[:a].count(TOKEN)
        for e in expansions[k : k + inner.count(TOKEN)]:
            inner = inner.replace(TOKEN, "\0" + e.replace(TOKEN, "\1"), 1)
        assert out.text[na:nb] == inner.replace("\0", "").replace("\1", TOKEN)
    # media spans cover exactly the expansions, in order
    assert _spans_text(out.text, list(out.media_spans)) == expansions
    # the declared runs kept as runs (those of one copy written out)
    assert out.pieces.runs == tuple(run for e in runs for run in e.runs)


def test_a_second_kind_is_found_in_the_whole_text() -> None:
    """Videos after images: the video placeholders are looked for in the images' expanded text too,
    as the processors' ``replace`` finds them, and the first kind's media spans move with the text."""
    video = "<|video_pad|>"
    text = f"a{TOKEN}b{video}c"
    images = [RunText.of(["<", (video, 2), ">"])]
    first = expand_placeholders(RenderedText(text=text, assistant_spans=[(0, len(text))]), TOKEN, images, "image")
    assert isinstance(first, ExpandedText)
    with pytest.raises(SampleError):
        expand_placeholders(first, video, [RunText.of(["V"])], "video")
    videos = [RunText.of([f"{k}"]) for k in range(3)]
    out = expand_placeholders(first, video, videos, "video")
    assert out.text == "a<01>b2c"
    assert out.media_spans == ((1, 5), (2, 3), (3, 4), (6, 7))  # the image's span holds its videos
    assert out.assistant_spans == [(0, len(out.text))]


def _inside_token(text: str, i: int) -> bool:
    return any(s < i < s + len(TOKEN) for s in range(len(text)) if text.startswith(TOKEN, s))


def test_count_mismatch_is_an_error_row() -> None:
    rendered = RenderedText(text=f"a{TOKEN}b", assistant_spans=[])
    with pytest.raises(SampleError) as err:
        expand_placeholders(rendered, TOKEN, [RunText.of(["x"]), RunText.of(["y"])], "image")
    assert err.value.reason == Reason.MEDIA_TAG_MISMATCH


def test_mask_never_covers_an_expansion(tmp_path) -> None:
    """An image inside an assistant turn: its expanded tokens get mask 0, the reply's text 1."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_processor_dir(tmp_path / "p"))
    text = f"user: hi\nassistant: see {TOKEN} here\n"
    start = text.index("see")
    rendered = RenderedText(text=text, assistant_spans=[(start, len(text))])
    out = expand_placeholders(rendered, TOKEN, [RunText.of(["\n\n", ("IMG ", 2), "\n\n"])], "image")
    enc = tok(out.text, add_special_tokens=False, return_offsets_mapping=True)
    mask = tokenize_rendered(tok, out).loss_mask
    ((m0, m1),) = out.media_spans
    offsets = np.asarray(enc["offset_mapping"])
    inside = (offsets[:, 0] < m1) & (offsets[:, 1] > m0)
    in_reply = (offsets[:, 0] < len(out.text)) & (offsets[:, 1] > out.assistant_spans[0][0])
    assert inside.any() and not mask[inside].any()
    assert mask[in_reply & ~inside].all()
