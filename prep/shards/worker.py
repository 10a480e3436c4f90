"""Shard worker: built once per process/actor, writes whole shards from plan tasks.

Reads the rows from memory-mapped parts and the media from files/LMDB, and writes each shard
via temp + rename (`write_tar_atomic`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from packvlm.faults import crash_point
from prep.shards.core import ShardTask, build_pack
from prep.shards.read import PartView, SampleRow
from prep.shards.tar import Member, write_tar_atomic
from prep.sources.media import LmdbPool
from schemas.packed import SHARDS_DIR, shard_name


class ShardWorker:
    """Built once per process/actor from JSON-safe kwargs; writes whole shards."""

    def __init__(self, parts_json: str, output_dir: str, pack_size: int, pad_to_multiple_of: int) -> None:
        self.parts: list[tuple[str, int]] = [(p, int(i)) for p, i in json.loads(parts_json)]
        self.shards = Path(output_dir) / SHARDS_DIR
        self.pack_size = int(pack_size)
        self.pad = int(pad_to_multiple_of)
        self.views: dict[int, PartView] = {}
        self.pool = LmdbPool()

    def _row(self, part: int, row: int) -> tuple[int, SampleRow]:
        view = self.views.get(part)
        if view is None:
            view = self.views[part] = PartView(self.parts[part][0])
        return self.parts[part][1], view.row(row)

    def _packs(self, task: ShardTask) -> Iterator[list[Member]]:
        for pack_index, rows in task.packs:
            loaded = [self._row(part, row) for part, row in rows]
            yield build_pack(pack_index, loaded, pack_size=self.pack_size, pad_to_multiple_of=self.pad, pool=self.pool)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        stats: dict[str, list] = {"shard": [], "packs": [], "samples": [], "bytes": [], "sha256": []}
        for text in batch["task"]:
            task = ShardTask.from_json(text)
            nbytes, sha256 = write_tar_atomic(self.shards / shard_name(task.shard), self._packs(task))
            crash_point("shards.after_shard")
            stats["shard"].append(task.shard)
            stats["packs"].append(len(task.packs))
            stats["samples"].append(sum(len(rows) for _, rows in task.packs))
            stats["bytes"].append(nbytes)
            stats["sha256"].append(sha256)
        return stats
