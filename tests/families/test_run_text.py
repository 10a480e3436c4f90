"""`RunText`: its text, length and prefix test against the pieces written out one by one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from families.run_text import RunText

PIECES = st.lists(
    st.one_of(
        st.sampled_from(["", "a", "<x>", "\n\n", "00:01 "]),
        st.tuples(st.sampled_from(["<x>", "b", ""]), st.integers(0, 5)),
    ),
    max_size=8,
)


def _written(pieces: list) -> str:
    return "".join(p if isinstance(p, str) else p[0] * p[1] for p in pieces)


@given(PIECES, PIECES, st.text(alphabet="ab<x>\n", max_size=12))
def test_pieces_text_length_and_prefix(first: list, second: list, prefix: str) -> None:
    inner = RunText.of(first)
    joined = RunText.of([*second, inner, "z", inner])
    for value, text in ((inner, _written(first)), (joined, _written(second) + _written(first) + "z" + _written(first))):
        assert value.text == str(value) == text
        assert value.num_chars == len(text)
        assert len(value.literals) == len(value.runs) + 1
        assert all(copies >= 2 for _, copies in value.runs)  # one copy or none is written out
        assert value.startswith(prefix) == text.startswith(prefix)
        assert value.startswith(text[:5]) and value.startswith(text)


def test_runs_are_kept_and_literals_joined() -> None:
    value = RunText.of(["a", "b", ("<x>", 3), ("<x>", 2), ("y", 1), "c"])
    assert value.literals == ("ab", "", "yc") and value.runs == (("<x>", 3), ("<x>", 2))
    with pytest.raises(ValueError, match="one literal more"):
        RunText(("a",), (("<x>", 2),))
