"""Video expansions through `RunEncoder`: many declared runs per text, cut and kept.

A video expands to one run of soft tokens per frame (Gemma 4) or per chunk (Kimi K2.5) between
timestamp text, and every clip length gives another text. The oracle: ids equal the tokenizer
called on the whole text (``tokenizer(text, return_offsets_mapping=True)``), and the mask the
overlap rule on its offsets, for the counters' own expansions and for random expansions built
from added tokens (runs of 1-300 copies, side by side, between plain text, overlapping tokens
among them). The counters declare every run: no soft token is left doubled in the short text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from families.counter import MediaRejected
from families.processor import load_processor
from families.registry import example_family, find_counter
from families.run_text import Piece, RunText
from packvlm.sample_error import SampleError
from prep.tokenize.expansion import ExpandedText
from prep.tokenize.runs import RunEncoder
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta
from tests.tokenize.run_truth import check, place

CONTEXT = ["", " ", "\n", "\n\n", "Frame 12", "a cat ", "x", "<start_of_turn>user\n", "00:01 ", "!\n"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("runs_video")
    return {f: load_processor(str(example_family(f).build_processor(Path(root) / f))) for f in ("gemma4", "kimi_k25")}


def _check(tok: Any, encoder: RunEncoder, expanded: ExpandedText) -> bool:
    """Both ways of adding specials; True where the short text alone was tokenized."""
    return all([check(tok, encoder, expanded, add_special) for add_special in (False, True)])


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
    """A counter's expansions, one encoder throughout."""
    counter = find_counter(bundle.processor_class)(bundle)  # type: ignore[misc]
    soft = bundle.tokenizer.convert_ids_to_tokens(counter.video_token_id)
    encoder = RunEncoder(bundle.tokenizer)
    texts: list[RunText] = []
    for meta in METAS:
        for sampling in SAMPLINGS if meta.num_frames <= 40 else SAMPLINGS[:1] + SAMPLINGS[2:]:
            try:
                count = counter.count_video(meta, sampling)
            except (MediaRejected, SampleError):  # a sampling the processor refuses: no text to expand
                continue
            assert count.expansion_runs is not None and count.expansion_text == count.expansion_runs.text
            texts.append(count.expansion_runs)
    assert len({t.text for t in texts}) >= 8
    compressed = 0
    for k, expansion in enumerate(texts):
        assert soft * 2 not in encoder._cut(expansion).text  # every run of the soft token declared
        before, between, after = CONTEXT[k % len(CONTEXT)], CONTEXT[(3 * k + 1) % len(CONTEXT)], CONTEXT[k % 3]
        other = texts[(k + 5) % len(texts)]
        for expansions, pieces in (([expansion], [before, after]), ([expansion, other], [before, between, after])):
            compressed += _check(bundle.tokenizer, encoder, place(expansions, pieces))
    assert compressed == 2 * len(texts)  # every video text has runs, and they were cut and kept
    assert encoder.eligible == {soft: True}


@st.composite
def _expansion(draw: st.DrawFn, tokens: list[str]) -> RunText:
    """Added tokens repeated 1-300 times (runs side by side included) between pieces of plain text."""
    parts = draw(
        st.lists(
            st.one_of(
                st.tuples(st.sampled_from(tokens), st.integers(1, 300)),
                st.sampled_from(["00:0", " ", "\n\n", "1", "video", "\0", "<"]),
            ),
            min_size=1,
            max_size=12,
        )
    )
    pieces: list[Piece] = parts
    return RunText.of(pieces)


def _gemma4_tokens(bundles: dict[str, Any]) -> list[str]:
    added = RunEncoder(bundles["gemma4"].tokenizer).added
    # soft tokens and wrappers, a reserved token, the turn markers, bos: overlapping ones included
    wanted = ["<|video|>", "<|image|>", "<|image>", "<image|>", "<unused1>", "<unused10>", "<bos>", "<eos>"]
    return [t for t in wanted if t in added]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_runs_tokenize_as_the_whole_text(bundles, data):
    """Random expansions of declared runs (compressible tokens or not) between random text."""
    tok = bundles["gemma4"].tokenizer
    tokens = _gemma4_tokens(bundles)
    assert len(tokens) >= 6
    encoder = RunEncoder(tok)
    expansions = data.draw(st.lists(_expansion(tokens), min_size=1, max_size=3))
    pieces = data.draw(st.lists(st.sampled_from(CONTEXT), min_size=len(expansions) + 1, max_size=len(expansions) + 1))
    n = place(expansions, pieces).pieces.num_chars
    ends = data.draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), max_size=3))
    expanded = place(expansions, pieces, sorted((min(a, b), max(a, b)) for a, b in ends))
    for add_special in (False, True):
        check(tok, encoder, expanded, add_special)
