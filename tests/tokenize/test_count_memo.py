"""`prep.tokenize.count_memo`: remembered counter answers equal the counter's own, numbered and sized.

The oracle is the family counter itself, asked afresh (each family's tests hold it equal to the
real processor); here MiniCPM-V 4.6's, the one counter that numbers its items, so a memo keyed
without the item's place would hand image 1 the ``<image_id>0`` of image 0.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from families.counter import MediaCount, MediaRejected
from families.minicpmv4_6.counter import MiniCPMV4_6Counter
from families.minicpmv4_6.example import build_minicpmv4_6_dir
from families.processor import ProcessorBundle, load_processor
from prep.tokenize.count_memo import CountMemo, with_num_bytes, with_source
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta

SIZES = [(1000, 300), (300, 1000), (448, 448), (449, 448), (1, 1), (3000, 2000)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ProcessorBundle:
    return load_processor(str(build_minicpmv4_6_dir(tmp_path_factory.mktemp("minicpmv4_6"))))


def _fresh(counter: MiniCPMV4_6Counter, width: int, height: int, index: int) -> MediaCount:
    return replace(counter.numbered(counter.count_image(width, height), index), width=width, height=height)


def test_with_source_copies_every_other_field():
    values = {f.name: f"v{i}" for i, f in enumerate(fields(MediaCount))}  # every field distinct, none default
    count = MediaCount(**values)  # type: ignore[arg-type]
    assert with_source(count, width=1, height=2, num_bytes=3) == replace(count, width=1, height=2, num_bytes=3)
    assert with_num_bytes(count, 7) == replace(count, num_bytes=7)


def test_remembered_images_equal_the_counter_per_place(bundle):
    counter = MiniCPMV4_6Counter.from_processor(bundle)
    memo = CountMemo(MiniCPMV4_6Counter.from_processor(bundle))
    for _ in range(2):  # misses, then hits
        for index in (0, 1, 2, 11, 0):
            for width, height in SIZES:
                assert memo.image(width, height, index) == _fresh(counter, width, height, index)
    assert memo.image(1000, 300, 1).expansion != memo.image(1000, 300, 0).expansion


def test_budget_drops_oldest_answers_first(bundle):
    counter = MiniCPMV4_6Counter.from_processor(bundle)
    one = len(_fresh(counter, 1000, 300, 0).expansion) + 1
    memo = CountMemo(counter, budget=2 * one + 1)  # room for two answers of that size
    for index in range(4):
        memo.image(1000, 300, index)
    assert list(memo._answers) == [("image", 1000, 300, 2), ("image", 1000, 300, 3)]
    assert memo._held == sum(len(c.expansion) + 1 for c in memo._answers.values()) <= memo.budget
    assert memo.image(1000, 300, 0) == _fresh(counter, 1000, 300, 0)  # recounted after it left
    too_big = CountMemo(counter, budget=one - 1)
    assert too_big.image(1000, 300, 0) == _fresh(counter, 1000, 300, 0)
    assert not too_big._answers


def test_refusals_are_not_remembered(bundle):
    memo = CountMemo(MiniCPMV4_6Counter.from_processor(bundle))
    for _ in range(2):
        with pytest.raises(MediaRejected, match="image of size 0x5"):
            memo.image(0, 5, 0)
    assert not memo._answers


def test_remembered_video_equals_the_counter(bundle):
    counter = MiniCPMV4_6Counter.from_processor(bundle)
    memo = CountMemo(counter)
    meta = VideoMeta(num_frames=46, fps=30000 / 1001, width=200, height=120)
    for sampling in (VideoSampling(), VideoSampling(max_frames=1), VideoSampling()):
        for index in (0, 1, 0):
            fresh = replace(
                counter.numbered(counter.count_video(meta, sampling), index), width=meta.width, height=meta.height
            )
            assert memo.video(meta, sampling, index) == fresh
    assert len(memo._answers) == 4


def test_each_item_gets_its_own_num_bytes(bundle):
    """A miss builds the answer with the asking item's size; a hit with another size copies it, one with the
    kept size hands the kept answer; every other field stays the counter's."""
    counter = MiniCPMV4_6Counter.from_processor(bundle)
    memo = CountMemo(counter)
    for num_bytes in (500, 500, 7, 0, 500):
        for index in (0, 1):
            got = memo.image(1000, 300, index, num_bytes)
            assert got == replace(_fresh(counter, 1000, 300, index), num_bytes=num_bytes)
    meta = VideoMeta(num_frames=46, fps=30000 / 1001, width=200, height=120)
    for num_bytes in (9000, 12, 9000):
        fresh = replace(counter.numbered(counter.count_video(meta, VideoSampling()), 0), width=200, height=120)
        assert memo.video(meta, VideoSampling(), 0, num_bytes) == replace(fresh, num_bytes=num_bytes)
    assert len(memo._answers) == 3
