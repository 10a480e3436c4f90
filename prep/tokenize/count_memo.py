"""A worker's counter answers, remembered per (size, place) so a repeated size costs a dict lookup.

A counter is a pure function of what it is asked: ``count_image(width, height)``,
``count_video(meta, sampling)``, and ``numbered(count, index)`` for a family whose expansion
names the item's place in its sample (MiniCPM-V's ``<image_id>k</image_id>``). Datasets repeat
sizes (a camera's 4032x3024, COCO's 640x480, every page of a scan; several questions on one
image), and building an expansion of hundreds to thousands of ids (MiniCPM-V tokenizes the digits
of k per item) costs more than the rest of the item. So `CountMemo` keeps the numbered answer per
key, the item's source size filled in, within a budget of ids and characters (oldest first out);
only ``num_bytes`` is set per item, where it differs from the kept answer's (a miss builds the answer
once, with the asking item's ``num_bytes``: a `MediaCount` costs microseconds to build). A refusal
(`MediaRejected`, `SampleError`) is never kept: the counter raises it again the next time, with the
same message.

Example (MiniCPM-V 4.6): a sample's second 1000x300 image -> key ("image", 1000, 300, 1) -> the
count of ``<image_id>1</image_id><image>`` + 60 pads + ``</image>`` + 3 slices, width 1000,
height 300; its next sample's first 1000x300 image is key ("image", 1000, 300, 0).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from families.counter import MediaCount, MediaCounter
from schemas.dataset_config import VideoSampling
from schemas.media import VideoMeta

#: ids plus expansion-text characters kept per worker (8-byte slots: at most ~16 MiB of answers)
MEMO_BUDGET = 1 << 21


class CountMemo:
    """`MediaCounter` answers of one worker, numbered and sized, by key (module docstring)."""

    def __init__(self, counter: MediaCounter, budget: int = MEMO_BUDGET) -> None:
        self.counter = counter
        self.numbered: Callable[[MediaCount, int], MediaCount] | None = getattr(counter, "numbered", None)
        self.budget = budget
        self._answers: dict[Hashable, MediaCount] = {}
        self._held = 0  # ids and characters in _answers

    def image(self, width: int, height: int, index: int, num_bytes: int = 0) -> MediaCount:
        """``count_image`` of a ``width`` x ``height`` image of ``num_bytes``, the ``index``-th image of its sample."""
        key = ("image", width, height, index if self.numbered else 0)
        found = self._answers.get(key)
        if found is None:
            return self._keep(key, self.counter.count_image(width, height), index, width, height, num_bytes)
        return found if found.num_bytes == num_bytes else with_num_bytes(found, num_bytes)

    def clear(self) -> None:
        """Forget every answer."""
        self._answers.clear()
        self._held = 0

    def video(self, meta: VideoMeta, sampling: VideoSampling, index: int, num_bytes: int = 0) -> MediaCount:
        """``count_video`` of a video of ``num_bytes``, the ``index``-th video of its sample."""
        key = ("video", meta, sampling, index if self.numbered else 0)
        found = self._answers.get(key)
        if found is None:
            count = self.counter.count_video(meta, sampling)
            return self._keep(key, count, index, meta.width, meta.height, num_bytes)
        return found if found.num_bytes == num_bytes else with_num_bytes(found, num_bytes)

    def _keep(
        self, key: Hashable, count: MediaCount, index: int, width: int, height: int, num_bytes: int
    ) -> MediaCount:
        if self.numbered is not None:
            count = self.numbered(count, index)
        count = with_source(count, width=width, height=height, num_bytes=num_bytes)
        size = _size(count)
        if size > self.budget:
            return count
        while self._held + size > self.budget:
            oldest = next(iter(self._answers))
            dropped = self._answers.pop(oldest)
            self._held -= _size(dropped)
        self._answers[key] = count
        self._held += size
        return count


def _size(count: MediaCount) -> int:
    """What the memo counts an answer as: its ids and characters, plus one."""
    runs = count.expansion_runs
    return len(count.expansion) + (0 if runs is None else runs.num_chars) + 1


def with_source(count: MediaCount, *, width: int, height: int, num_bytes: int) -> MediaCount:
    """``dataclasses.replace(count, width=..., height=..., num_bytes=...)`` built directly (a third
    cheaper; it runs for every item). `tests/tokenize/test_count_memo.py` checks it copies every other field."""
    return MediaCount(
        kind=count.kind,
        grid_t=count.grid_t,
        grid_h=count.grid_h,
        grid_w=count.grid_w,
        num_tokens=count.num_tokens,
        expansion=count.expansion,
        expansion_runs=count.expansion_runs,
        num_tiles=count.num_tiles,
        frame_indices=count.frame_indices,
        timestamps=count.timestamps,
        width=width,
        height=height,
        num_bytes=num_bytes,
    )


def with_num_bytes(count: MediaCount, num_bytes: int) -> MediaCount:
    """``count`` with its item's encoded size."""
    return with_source(count, width=count.width, height=count.height, num_bytes=num_bytes)
