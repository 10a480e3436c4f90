"""Energon load hooks for packed datasets: cooker and TaskEncoder base, shared by prep and train.

`prep energon-index --verify` and `train` load shards through these, so both read a pack the
same way. Plug the cooker into your own TaskEncoder and keep media as the original encoded
bytes by turning Energon's auto-decoder off (otherwise ``.jpg`` members arrive decoded)::

    from megatron.energon import DefaultTaskEncoder
    from packvlm.energon import PACK_COOKER

    class MyEncoder(DefaultTaskEncoder):
        cookers = [PACK_COOKER]
        decoder = None  # raw bytes in; the cooker parses json/npy itself

`PackedTaskEncoder` is exactly that. The cooker is `@stateless`: it reads only its input, so
Energon can replay it when restoring a checkpointed loader. A cooked `PackedSample` carries
Energon's bookkeeping (``__key__``, restore key, sources) around the plain
`schemas.packed.LoadedPack` that the rest of packvlm works on.
"""

from __future__ import annotations

import io
import json
import warnings
from typing import Any, TypeVar

import numpy as np
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, edataclass, stateless

from packvlm.errors import UsageError
from schemas.packed import (
    INPUT_IDS_MEMBER,
    LOSS_MASK_MEMBER,
    META_MEMBER,
    PACK_SUBFLAVORS,
    LoadedPack,
    PackedMediaItem,
    PackMeta,
)

PIN_MEMORY_WARNING = "'pin_memory' argument is set as true but no accelerator is found"  # torch's DataLoader

T_encoded = TypeVar("T_encoded")
T_raw_batch = TypeVar("T_raw_batch")
T_batch = TypeVar("T_batch")


def quiet_pin_memory_without_accelerator() -> None:
    """Energon's loaders always ask torch to pin memory; without a GPU torch warns about it at
    every iteration start (nothing is pinned either way). Filter exactly that warning, for
    `prep energon-index --verify` and `train` on CPU."""
    warnings.filterwarnings("ignore", message=PIN_MEMORY_WARNING, category=UserWarning)


class PackDecodeError(UsageError, ValueError):
    """A crude sample is not a well-formed pack (or arrived decoded by Energon's decoder)."""


@edataclass
class PackedSample(Sample):
    """One pack as Energon yields it: Energon's sample keys plus the pack itself."""

    pack: LoadedPack


def _member(sample: dict[str, Any], part: str) -> Any:
    if part not in sample:
        raise PackDecodeError(f"{sample.get('__key__')}: member {part!r} missing; is this a `prep pack` shard?")
    return sample[part]


def _array(value: Any, part: str, key: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        array: np.ndarray = np.load(io.BytesIO(bytes(value)), allow_pickle=False)
        return array
    raise PackDecodeError(f"{key}: {part} has type {type(value).__name__}, expected npy bytes")


def _meta(value: Any, key: str) -> PackMeta:
    try:
        raw = value if isinstance(value, dict) else json.loads(bytes(value))
        return PackMeta.from_json(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise PackDecodeError(f"{key}: bad pack json ({exc})") from exc


def decode_pack(sample: dict[str, Any]) -> LoadedPack:
    """A crude pack (member suffix -> bytes) -> `LoadedPack`; checks array lengths and media types."""
    key = str(sample.get("__key__"))
    meta = _meta(_member(sample, META_MEMBER), key)
    input_ids = _array(_member(sample, INPUT_IDS_MEMBER), INPUT_IDS_MEMBER, key)
    loss_mask = _array(_member(sample, LOSS_MASK_MEMBER), LOSS_MASK_MEMBER, key)
    if input_ids.shape != (meta.num_tokens,) or loss_mask.shape != input_ids.shape:
        raise PackDecodeError(
            f"{key}: arrays {input_ids.shape}/{loss_mask.shape} but json says {meta.num_tokens} tokens"
        )
    media = []
    for item in meta.media:
        data = _member(sample, item.member)
        if not isinstance(data, (bytes, bytearray)):
            raise PackDecodeError(
                f"{key}: media {item.member} arrived as {type(data).__name__}, not bytes; set `decoder = None` "
                "on your TaskEncoder"
            )
        media.append(PackedMediaItem(meta=item, data=bytes(data)))
    return LoadedPack(
        meta=meta,
        input_ids=input_ids.astype(np.int32, copy=False),
        loss_mask=loss_mask.astype(np.uint8, copy=False),
        media=tuple(media),
    )


@stateless
def cook_pack(sample: dict[str, Any]) -> PackedSample:
    """Energon cooker: a crude pack -> `PackedSample` (see `decode_pack`).

    The json's key must be the webdataset key, so ``pack.key`` (in metrics and errors)
    names the pack Energon read.
    """
    pack = decode_pack(sample)
    if pack.key != sample.get("__key__"):
        raise PackDecodeError(f"{sample.get('__key__')}: its json member belongs to pack {pack.key}")
    return PackedSample(**basic_sample_keys(sample), pack=pack)


PACK_COOKER: Cooker[PackedSample] = Cooker(cook=cook_pack, has_subflavors=PACK_SUBFLAVORS)


class PackedTaskEncoder(DefaultTaskEncoder[PackedSample, T_encoded, T_raw_batch, T_batch]):
    """Loads packed datasets as `PackedSample`s: our cooker, raw bytes (no decoder).

    Used as is it yields `PackedSample`s; subclass it and override ``encode_sample`` /
    ``batch`` / ``encode_batch`` to turn them into model inputs (`train.encoder`).
    """

    cookers = [PACK_COOKER]
    decoder = None
