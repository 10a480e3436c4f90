"""Shard worker: one task = one shard, built from (part id, row) lists of a frozen plan.

A task names packs and, per pack, the tokenized rows in pack order; the worker reads the
rows from memory-mapped parts and the media from files/LMDB, and writes the shard via
temp + rename. Same task -> same bytes (no clocks, no randomness, fixed tar metadata).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prep.shards.read import MediaVanishedError, PartView, SampleRow, TokenizedPartError, read_media
from prep.shards.tar import Member, write_tar_atomic
from prep.sources.media import LmdbPool
from schemas.packed import (
    INPUT_IDS_MEMBER,
    LOSS_MASK_MEMBER,
    META_MEMBER,
    SHARDS_DIR,
    PackedMedia,
    PackedSampleMeta,
    PackMeta,
    media_member,
    pack_key,
    shard_name,
)


class PackOverflowError(RuntimeError):
    """A pack's slots exceed pack_size at write time: the plan and the parts disagree."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardTask:
    """One shard: (pack index, ((part id, row), ...)) per pack, in plan order."""

    shard: int
    packs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    def to_json(self) -> str:
        return json.dumps({"shard": self.shard, "packs": self.packs}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ShardTask:
        raw = json.loads(text)
        packs = tuple((int(p), tuple((int(a), int(b)) for a, b in rows)) for p, rows in raw["packs"])
        return cls(shard=int(raw["shard"]), packs=packs)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def build_pack(
    pack_index: int, rows: list[tuple[int, SampleRow]], *, pack_size: int, pad_to_multiple_of: int, pool: LmdbPool
) -> list[Member]:
    """Members of one pack from its (input index, row) list, in pack order."""
    key = pack_key(pack_index)
    lengths = [r.input_ids.size for _, r in rows]
    slots = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in lengths]
    cu, cu_padded = np.cumsum([0, *lengths]).tolist(), np.cumsum([0, *slots]).tolist()
    if cu_padded[-1] > pack_size:
        ids = [r.sample_id for _, r in rows]
        raise PackOverflowError(
            f"{key}: samples {ids} take {cu_padded[-1]} slot tokens > pack_size {pack_size}; the tokenized "
            "parts changed since planning, rerun `prep pack` into a new directory"
        )
    members: list[Member] = []
    samples, media = [], []
    for i, (input_index, row) in enumerate(rows):
        first = len(media)
        for item in row.media:
            member = media_member(item["kind"], len(media), item["ref"])
            members.append((f"{key}.{member}", read_media(item["ref"], row.sample_id, pool)))
            media.append(
                PackedMedia(
                    kind=item["kind"],
                    ref=item["ref"],
                    member=member,
                    sample=i,
                    grid_thw=(item["grid_t"], item["grid_h"], item["grid_w"]),
                    num_tokens=item["num_tokens"],
                    frame_indices=tuple(item["frame_indices"]),
                    timestamps=tuple(item["timestamps"]),
                )
            )
        samples.append(
            PackedSampleMeta(
                input=input_index,
                sample_id=row.sample_id,
                dataset=row.dataset,
                num_tokens=lengths[i],
                media=tuple(range(first, len(media))),
            )
        )
    meta = PackMeta(
        key=key,
        pack_size=pack_size,
        num_tokens=cu[-1],
        cu_seqlens=tuple(cu),
        cu_seqlens_padded=tuple(cu_padded),
        samples=tuple(samples),
        media=tuple(media),
    )
    ids = np.concatenate([r.input_ids for _, r in rows]).astype(np.int32, copy=False)
    mask = np.concatenate([r.loss_mask for _, r in rows]).astype(np.uint8, copy=False)
    members.append((f"{key}.{META_MEMBER}", json.dumps(meta.to_json(), sort_keys=True, separators=(",", ":")).encode()))
    members.append((f"{key}.{INPUT_IDS_MEMBER}", _npy(ids)))
    members.append((f"{key}.{LOSS_MASK_MEMBER}", _npy(mask)))
    return members


_WORKER_ERRORS = {e.__name__: e for e in (MediaVanishedError, TokenizedPartError, PackOverflowError)}
_REMOTE_ERROR = re.compile(rf"\b({'|'.join(_WORKER_ERRORS)}): (.+)")


def unwrap_worker_error(exc: BaseException) -> Exception | None:
    """Our input error inside a Ray-wrapped exception, re-created with its own message.

    Ray Data re-raises worker failures as ``UserCodeException`` whose cause does not survive
    the trip; the remote traceback text does, so the error is recovered from it.
    """
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, tuple(_WORKER_ERRORS.values())):
            return cur if isinstance(cur, Exception) else None
        match = _REMOTE_ERROR.search(str(cur))
        if match:
            return _WORKER_ERRORS[match.group(1)](match.group(2).strip())
        cur = cur.__cause__ or cur.__context__
    return None


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
        stats: dict[str, list] = {"shard": [], "packs": [], "samples": [], "bytes": []}
        for text in batch["task"]:
            task = ShardTask.from_json(text)
            nbytes = write_tar_atomic(self.shards / shard_name(task.shard), self._packs(task))
            stats["shard"].append(task.shard)
            stats["packs"].append(len(task.packs))
            stats["samples"].append(sum(len(rows) for _, rows in task.packs))
            stats["bytes"].append(nbytes)
        return stats
