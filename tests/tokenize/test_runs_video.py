"""Video expansions through `RunEncoder`: many runs per text, found by the tokens seen before.

A video expands to one run of soft tokens per frame (Gemma 4) or per chunk (Kimi K2.5) between
timestamp text, and every clip length gives another text. Two oracles, both independent of the
encoder's search:

- ids and offsets equal the tokenizer called on the whole text (``tokenizer(text,
  return_offsets_mapping=True)``), for the counters' own expansion texts and for random texts
  built from added tokens (runs of 1-300 copies, side by side, between plain text);
- the runs found equal a regex ``(?:x){2,}`` over the text for every compressible token ``x``
  (what the encoder looked for before it learnt which tokens form runs), whatever the encoder
  has seen before, including texts evicted from its bounded memo.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from families.counter import MediaRejected
from families.processor import load_processor
from families.registry import example_family, find_counter
from packvlm.sample_error import SampleError
from prep.tokenize.runs import MEMO_TEXTS, Run, RunEncoder
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from tests.tokenize.run_truth import check_mask, truth

CONTEXT = ["", " ", "\n", "\n\n", "Frame 12", "a cat ", "x", "<start_of_turn>user\n", "00:01 ", "!\n"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("runs_video")
    return {f: load_processor(str(example_family(f).build_processor(Path(root) / f))) for f in ("gemma4", "kimi_k25")}


def _regex_runs(encoder: RunEncoder, text: str) -> list[Run]:
    """Every maximal run of two or more copies of every compressible added token."""
    return sorted(
        (m.start(), m.end(), x, (m.end() - m.start()) // len(x))
        for x in encoder.added
        if encoder.compressible(x)
        for m in re.finditer(f"(?:{re.escape(x)}){{2,}}", text)
    )


def _place(expansions: list[str], pieces: list[str]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``pieces[0] + e0 + pieces[1] + e1 + ...``, with the media spans where the expansions sit."""
    text, spans = pieces[0], []
    for e, after in zip(expansions, pieces[1:], strict=True):
        spans.append((len(text), len(text) + len(e)))
        text += e + after
    return text, tuple(spans)


def _check(tok: Any, encoder: RunEncoder, text: str, spans: tuple[tuple[int, int], ...]) -> None:
    for add_special in (False, True):
        ids, offsets = encoder.encode(text, spans, add_special)
        assert (ids, offsets.tolist()) == truth(tok, text, add_special), text[:200]
        check_mask(tok, encoder, text, spans, add_special)
    for a, b in spans:
        assert list(encoder.runs_in(text[a:b])) == _regex_runs(encoder, text[a:b])


# (frames, fps, width, height): one frame, chunks of 4 with a short last one, 32 frames sampled from
# long clips, NTSC rates, hours of video (Kimi's timestamps wrap at 24 h), tiny and wide frames
METAS = [
    VideoMeta(num_frames=1, fps=24.0, width=64, height=48),
    VideoMeta(num_frames=11, fps=6.0, width=96, height=64),
    VideoMeta(num_frames=300, fps=30.0, width=640, height=360),
    VideoMeta(num_frames=150, fps=30000 / 1001, width=854, height=480),
    VideoMeta(num_frames=40, fps=0.5, width=100, height=74),
    VideoMeta(num_frames=1000, fps=0.01, width=16, height=16),
    VideoMeta(num_frames=40, fps=10.0, width=2000, height=16),
]
SAMPLINGS = [VideoSampling(), VideoSampling(fps=None), VideoSampling(fps=0.5), VideoSampling(fps=3.0)]


def test_gemma4_video_texts_tokenize_as_the_whole_text(bundles):
    _check_counter_texts(bundles["gemma4"])


def test_kimi_k25_video_texts_tokenize_as_the_whole_text(bundles):
    """The counter needs no torchvision (its settings are read from the JSON files)."""
    _check_counter_texts(bundles["kimi_k25"])


def _check_counter_texts(bundle: Any) -> None:
    """A counter's expansions, one encoder throughout: the first text teaches it the soft token."""
    counter = find_counter(bundle.processor_class)(bundle)  # type: ignore[misc]
    encoder = RunEncoder(bundle.tokenizer)
    texts = []
    for meta in METAS:
        for sampling in SAMPLINGS if meta.num_frames <= 40 else SAMPLINGS[:1] + SAMPLINGS[2:]:
            try:
                count = counter.count_video(meta, sampling)
            except (MediaRejected, SampleError):  # a sampling the processor refuses: no text to expand
                continue
            assert count.expansion_text is not None
            texts.append(count.expansion_text)
    assert len(set(texts)) >= 8
    compressed = 0
    for k, expansion in enumerate(texts):
        before, between, after = CONTEXT[k % len(CONTEXT)], CONTEXT[(3 * k + 1) % len(CONTEXT)], CONTEXT[k % 3]
        other = texts[(k + 5) % len(texts)]
        for expansions, pieces in (([expansion], [before, after]), ([expansion, other], [before, between, after])):
            text, spans = _place(expansions, pieces)
            _check(bundle.tokenizer, encoder, text, spans)
            compressed += len(encoder._absolute_runs(text, spans)) > 0
    assert compressed == 2 * len(texts)  # every video text has runs, and they were used
    assert encoder.hot == [bundle.tokenizer.convert_ids_to_tokens(counter.video_token_id)]  # learnt once


@st.composite
def _expansion(draw: st.DrawFn, tokens: list[str]) -> str:
    """Added tokens repeated 1-300 times (runs side by side included) between pieces of plain text."""
    parts = draw(
        st.lists(
            st.one_of(
                st.tuples(st.sampled_from(tokens), st.integers(1, 300)),
                st.tuples(st.sampled_from(["00:0", " ", "\n\n", "1", "video", "\0", "<"]), st.just(1)),
            ),
            min_size=1,
            max_size=12,
        )
    )
    return "".join(piece * copies for piece, copies in parts)


def _gemma4_tokens(bundles: dict[str, Any]) -> list[str]:
    added = RunEncoder(bundles["gemma4"].tokenizer).added
    # soft tokens and wrappers, a reserved token, the turn markers, bos: overlapping ones included
    wanted = ["<|video|>", "<|image|>", "<|image>", "<image|>", "<unused1>", "<unused10>", "<bos>", "<eos>"]
    return [t for t in wanted if t in added]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_runs_tokenize_as_the_whole_text(bundles, data):
    """Random expansions through one encoder per example that first saw another random text (its hot
    tokens differ from the ones this text needs), then a tiny memo (evictions)."""
    tok = bundles["gemma4"].tokenizer
    tokens = _gemma4_tokens(bundles)
    assert len(tokens) >= 6
    encoder = RunEncoder(tok)
    warm = data.draw(_expansion(tokens))
    encoder.runs_in(warm)
    expansions = data.draw(st.lists(_expansion(tokens), min_size=1, max_size=3))
    pieces = data.draw(st.lists(st.sampled_from(CONTEXT), min_size=len(expansions) + 1, max_size=len(expansions) + 1))
    text, spans = _place(expansions, pieces)
    _check(tok, encoder, text, spans)


def test_memo_keeps_the_newest_texts_and_evicted_texts_stay_exact(bundles):
    bundle = bundles["kimi_k25"]
    counter = find_counter(bundle.processor_class)(bundle)  # type: ignore[misc]
    encoder = RunEncoder(bundle.tokenizer)
    every = VideoSampling(fps=None)  # n chunks of 4 frames: a text per n
    metas = [VideoMeta(num_frames=4 * n, fps=4.0, width=64, height=48) for n in range(1, MEMO_TEXTS + 21)]
    texts = [str(counter.count_video(meta, every).expansion_text) for meta in metas]
    assert len(set(texts)) == len(texts)
    for expansion in texts:
        encoder.runs_in(expansion)
    assert len(encoder.runs) == MEMO_TEXTS and texts[0] not in encoder.runs and texts[-1] in encoder.runs
    for expansion in (texts[0], texts[19], texts[-1]):  # evicted, evicted, kept
        _check(bundle.tokenizer, encoder, *_place([expansion], ["Frame 12", "x"]))
