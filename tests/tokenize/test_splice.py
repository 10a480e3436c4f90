"""`splice_media` against a token-by-token splice: each kind's k-th placeholder becomes its k-th item's ids.

The oracle walks the ids one at a time with a queue per kind (what the processor's own expansion
does); hypothesis draws ids with image and video placeholders in any order, items of 0-40 ids, a
kind without a placeholder token (-1) and counts that do not match (an error row naming the kind).
`_text_level_kinds` (which kinds were expanded as text before tokenizing) against its definition.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from families.counter import MediaCount
from families.run_text import RunText
from packvlm.sample_error import SampleError
from prep.tokenize.core import _text_level_kinds, splice_media
from schemas.reasons import Reason

IMAGE, VIDEO = 7, 9


def _item(kind: str, ids: list[int]) -> tuple[str, MediaCount]:
    count = MediaCount(kind=kind, grid_t=1, grid_h=1, grid_w=1, num_tokens=len(ids), expansion=tuple(ids))  # type: ignore[arg-type]
    return f"{kind}.bin", count


def _oracle(
    ids: list[int], mask: list[int], counts: list[tuple[str, MediaCount]], placeholders: dict[str, int]
) -> tuple[list[int], list[int]]:
    queues = {token: [c.expansion for _, c in counts if c.kind == kind] for kind, token in placeholders.items()}
    out_ids: list[int] = []
    out_mask: list[int] = []
    for token, bit in zip(ids, mask, strict=True):
        if token in queues:
            expansion = queues[token].pop(0)
            out_ids += expansion
            out_mask += [0] * len(expansion)
        else:
            out_ids.append(token)
            out_mask.append(bit)
    return out_ids, out_mask


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_splice_equals_the_token_by_token_splice(data):
    ids = data.draw(st.lists(st.sampled_from([1, 2, 3, IMAGE, VIDEO]), max_size=40))
    mask = data.draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    kinds = [{IMAGE: "image", VIDEO: "video"}[t] for t in ids if t in (IMAGE, VIDEO)]
    counts = [_item(kind, data.draw(st.lists(st.integers(100, 200), max_size=40))) for kind in kinds]
    placeholders = {"image": IMAGE, "video": VIDEO}
    if not any(k == "video" for k in kinds) and data.draw(st.booleans()):
        placeholders["video"] = -1  # a family without a video token
    got_ids, got_mask = splice_media(ids, np.asarray(mask, dtype=np.uint8), counts, placeholders)
    expect_ids, expect_mask = _oracle(ids, mask, counts, placeholders)
    assert got_ids == expect_ids
    assert got_mask.dtype == np.uint8 and got_mask.tolist() == expect_mask


@pytest.mark.parametrize(
    ("ids", "kinds", "message"),
    [
        ([1, IMAGE, 2], ["image", "image"], "1 image placeholder tokens for 2 images"),
        ([1, IMAGE, VIDEO, VIDEO], ["image", "video"], "2 video placeholder tokens for 1 videos"),
        ([1, 2], ["video"], "0 video placeholder tokens for 1 videos"),
    ],
)
def test_placeholder_count_mismatch_is_an_error_row(ids, kinds, message):
    counts = [_item(kind, [100]) for kind in kinds]
    with pytest.raises(SampleError) as err:
        splice_media(ids, np.zeros(len(ids), dtype=np.uint8), counts, {"image": IMAGE, "video": VIDEO})
    assert err.value.reason == Reason.MEDIA_TAG_MISMATCH and message in str(err.value)


def test_videos_for_a_family_without_a_video_token_are_an_error_row():
    """-1 (no such token) is never searched for; its items still need placeholders, of which there are none."""
    counts = [_item("image", [100]), _item("video", [101])]
    with pytest.raises(SampleError) as err:
        splice_media([1, IMAGE, 2], np.zeros(3, dtype=np.uint8), counts, {"image": IMAGE, "video": -1})
    assert err.value.reason == Reason.MEDIA_TAG_MISMATCH
    assert "0 video placeholder tokens for 1 videos" in str(err.value)


def test_the_spliced_mask_is_a_writable_uint8_array():
    mask = np.array([1, 0, 1], dtype=np.uint8)
    ids, got = splice_media([5, IMAGE, 6], mask, [_item("image", [100, 101])], {"image": IMAGE, "video": VIDEO})
    assert ids == [5, 100, 101, 6] and got.tolist() == [1, 0, 0, 1]
    assert got.dtype == np.uint8 and got.flags.writeable


def _item_as(kind: str, as_text: bool) -> tuple[str, MediaCount]:
    """An item expanded as text (``expansion_runs`` set) or as ids."""
    ref, count = _item(kind, [100])
    return ref, replace(count, expansion_runs=RunText.of(["<pad>"]) if as_text else None)


@pytest.mark.parametrize(
    ("items", "want"),
    [
        ([], ()),
        ([("image", False), ("video", False)], ()),
        ([("video", True), ("image", True)], ("image", "video")),  # in kind order, whatever the item order
        ([("video", True), ("image", False), ("video", True)], ("video",)),
        ([("image", True), ("image", True), ("video", False)], ("image",)),
    ],
)
def test_text_level_kinds_are_the_kinds_expanded_as_text(items, want):
    counts = [_item_as(kind, as_text) for kind, as_text in items]
    assert _text_level_kinds(counts) == want


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_kind_mixing_text_and_id_expansions_is_refused(kind):
    counts = [_item_as("image", True), _item_as(kind, False), _item_as("video", True)]
    with pytest.raises(ValueError, match=f"counter mixes text and id expansions for {kind}s"):
        _text_level_kinds(counts)
