"""One shard task and the tar members of one pack: pure functions of the plan and the rows.

A task names packs and, per pack, the tokenized rows in pack order (never data); the same
task gives the same members, byte for byte (no clocks, no randomness).
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass

import numpy as np

from packvlm.errors import InternalError
from prep.shards.read import SampleRow, read_media
from prep.shards.tar import Member
from prep.sources.media import LmdbPool
from schemas.packed import (
    INPUT_IDS_MEMBER,
    LOSS_MASK_MEMBER,
    META_MEMBER,
    PackedMedia,
    PackedSampleMeta,
    PackMeta,
    media_member,
    pack_key,
)
from schemas.plan import slot_tokens


class PackOverflowError(InternalError):
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
    slots = [slot_tokens(n, pad_to_multiple_of) for n in lengths]
    cu, cu_padded = np.cumsum([0, *lengths]).tolist(), np.cumsum([0, *slots]).tolist()
    if cu_padded[-1] > pack_size:
        ids = [r.sample_id for _, r in rows]
        raise PackOverflowError(
            f"{key}: samples {ids} take {cu_padded[-1]} slot tokens > pack_size {pack_size}; the tokenized "
            "parts changed since planning, rerun `prep pack` into a new directory"
        )
    members: list[Member] = []
    samples: list[PackedSampleMeta] = []
    media: list[PackedMedia] = []
    for i, (input_index, row) in enumerate(rows):
        first = len(media)
        for item in row.media:
            member = media_member(item["kind"], len(media), item["ref"])
            read = functools.partial(read_media, item["ref"], row.sample_id, pool)  # on the tar writer's thread
            members.append((f"{key}.{member}", read))
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
                    num_tiles=item["num_tiles"],
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
        num_tokens=cu[-1],
        cu_seqlens=tuple(cu),
        cu_seqlens_padded=tuple(cu_padded),
        samples=tuple(samples),
        media=tuple(media),
    )
    input_ids = np.concatenate([r.input_ids for _, r in rows]).astype(np.int32, copy=False)
    loss_mask = np.concatenate([r.loss_mask for _, r in rows]).astype(np.uint8, copy=False)
    members.append((f"{key}.{META_MEMBER}", json.dumps(meta.to_json(), sort_keys=True, separators=(",", ":")).encode()))
    members.append((f"{key}.{INPUT_IDS_MEMBER}", _npy(input_ids)))
    members.append((f"{key}.{LOSS_MASK_MEMBER}", _npy(loss_mask)))
    return members
