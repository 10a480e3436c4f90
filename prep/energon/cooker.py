"""Energon cooker for `prep pack` shards: a crude pack dict -> a typed `PackedSample`.

Plug it into your TaskEncoder and keep media as the original encoded bytes by turning
Energon's auto-decoder off (otherwise ``.jpg`` members arrive as decoded tensors)::

    from megatron.energon import DefaultTaskEncoder
    from prep.energon.cooker import PACK_COOKER

    class MyEncoder(DefaultTaskEncoder):
        cookers = [PACK_COOKER]
        decoder = None  # raw bytes in; the cooker parses json/npy itself

`PackedTaskEncoder` is exactly that. The cooker is `@stateless`: it reads only its input,
so Energon can replay it when restoring a checkpointed loader.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, edataclass, stateless

from schemas.packed import INPUT_IDS_MEMBER, LOSS_MASK_MEMBER, META_MEMBER, PACK_SUBFLAVORS, PackMeta


class PackDecodeError(ValueError):
    """A crude sample is not a well-formed pack (or arrived decoded by Energon's decoder)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMediaItem:
    """One media item: its original bytes and what the model's processor needs."""

    kind: str  # "image" | "video"
    data: bytes  # encoded file bytes, never re-encoded
    sample: int  # index of its sample in the pack
    grid_thw: tuple[int, int, int]
    frame_indices: tuple[int, ...]  # video frames the tokenizer counted (empty for images)
    member: str


@edataclass
class PackedSample(Sample):
    """One pack: samples concatenated; sample i owns tokens [cu_seqlens[i], cu_seqlens[i+1])."""

    #: int32 [T]
    input_ids: np.ndarray
    #: uint8 [T], 1 on tokens to learn
    loss_mask: np.ndarray
    #: int32 [S+1] boundaries of the real tokens
    cu_seqlens: np.ndarray
    #: int32 [S+1] boundaries of the slots (lengths rounded up to pad_to_multiple_of)
    cu_seqlens_padded: np.ndarray
    #: tokenized sample ids, in pack order
    sample_ids: list[str]
    #: media items in token order
    media: list[PackedMediaItem]
    #: capacity of the pack in tokens
    pack_size: int


def _raw(sample: dict[str, Any], part: str) -> Any:
    if part not in sample:
        raise PackDecodeError(f"{sample.get('__key__')}: member {part!r} missing; is this a `prep pack` shard?")
    return sample[part]


def _array(value: Any, part: str, key: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.load(io.BytesIO(bytes(value)), allow_pickle=False)
    raise PackDecodeError(f"{key}: {part} has type {type(value).__name__}, expected npy bytes")


def _meta(value: Any, key: str) -> PackMeta:
    raw = value if isinstance(value, dict) else json.loads(bytes(value))
    try:
        return PackMeta.from_json(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise PackDecodeError(f"{key}: bad pack json ({exc})") from exc


@stateless
def cook_pack(sample: dict) -> PackedSample:
    """Turn a crude pack (member suffix -> bytes) into a `PackedSample`; checks lengths."""
    key = str(sample.get("__key__"))
    meta = _meta(_raw(sample, META_MEMBER), key)
    input_ids = _array(_raw(sample, INPUT_IDS_MEMBER), INPUT_IDS_MEMBER, key)
    loss_mask = _array(_raw(sample, LOSS_MASK_MEMBER), LOSS_MASK_MEMBER, key)
    if input_ids.shape != (meta.num_tokens,) or loss_mask.shape != input_ids.shape:
        raise PackDecodeError(
            f"{key}: arrays {input_ids.shape}/{loss_mask.shape} but json says {meta.num_tokens} tokens"
        )
    media = []
    for item in meta.media:
        data = _raw(sample, item.member)
        if not isinstance(data, (bytes, bytearray)):
            raise PackDecodeError(
                f"{key}: media {item.member} arrived as {type(data).__name__}, not bytes; set `decoder = None` "
                "on your TaskEncoder"
            )
        media.append(
            PackedMediaItem(
                kind=item.kind,
                data=bytes(data),
                sample=item.sample,
                grid_thw=item.grid_thw,
                frame_indices=item.frame_indices,
                member=item.member,
            )
        )
    return PackedSample(
        **basic_sample_keys(sample),
        input_ids=input_ids.astype(np.int32, copy=False),
        loss_mask=loss_mask.astype(np.uint8, copy=False),
        cu_seqlens=np.asarray(meta.cu_seqlens, np.int32),
        cu_seqlens_padded=np.asarray(meta.cu_seqlens_padded, np.int32),
        sample_ids=[s.sample_id for s in meta.samples],
        media=media,
        pack_size=meta.pack_size,
    )


PACK_COOKER: Cooker[PackedSample] = Cooker(cook=cook_pack, has_subflavors=PACK_SUBFLAVORS)


class PackedTaskEncoder(DefaultTaskEncoder):
    """Loads `prep pack` datasets as `PackedSample`s: our cooker, raw bytes (no decoder)."""

    cookers = [PACK_COOKER]
    decoder = None
