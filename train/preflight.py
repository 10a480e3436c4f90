"""Checks `train` runs before it claims ``--output``: what would otherwise fail inside a loader worker.

A video reaching a family whose video processor is missing (HF video processors need
torchvision) fails in a DataLoader worker, after the model is built and the run folder claimed.
`first_video` finds the first video of a split from Energon's ``index.sqlite`` (member names
``pack-NNNNNNNN.vidKKKK.<ext>``, `schemas.packed`) without opening a shard, so the command can
stop first with the install line (exit 3). Without the sqlite index (it is optional for loading)
the check is skipped and the worker's error, the same one, ends the run instead.

    first_video(root, shard_packs={"shards/shard-000000.tar": 10}, split_shards=["shards/shard-000000.tar"])
    -> "pack pack-00000001, member vid0008.mp4"     or None
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path

from schemas.energon import INDEX_SQLITE, META_DIR
from schemas.packed import KEY_PREFIX

VIDEO_MEMBER_PREFIX = "vid"  # `schemas.packed.member_suffix` of a video item


def split_pack_ranges(shard_packs: Mapping[str, int], split_shards: Sequence[str]) -> list[tuple[int, int]]:
    """Half-open pack index ranges of ``split_shards``; packs are numbered in shard order (`prep pack`)."""
    wanted = set(split_shards)
    ranges, start = [], 0
    for name, count in shard_packs.items():
        if name in wanted:
            ranges.append((start, start + count))
        start += count
    return ranges


def first_video(root: Path, *, shard_packs: Mapping[str, int], split_shards: Sequence[str]) -> str | None:
    """The first video member of the split's packs, as ``pack KEY, member NAME``; None if none or no index."""
    index = root / META_DIR / INDEX_SQLITE
    if not index.is_file():
        return None
    ranges = split_pack_ranges(shard_packs, split_shards)
    query = (
        "SELECT s.sample_key, p.part_name FROM sample_parts p JOIN samples s "
        "ON s.tar_file_id = p.tar_file_id AND s.sample_index = p.sample_index WHERE p.part_name LIKE ?"
    )
    try:
        with sqlite3.connect(f"file:{index}?mode=ro", uri=True) as db:
            for key, part in db.execute(query, (f"{VIDEO_MEMBER_PREFIX}%",)):
                number = key.removeprefix(KEY_PREFIX)
                if number.isdigit() and any(a <= int(number) < b for a, b in ranges):
                    return f"pack {key}, member {part}"
    except sqlite3.Error:  # an index of another Energon version: leave it to the loader
        return None
    return None
