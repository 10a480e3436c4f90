"""Layout of a packed directory: `prep pack` (plan) + `prep shards` (webdataset shards).

Directory (``OUT``)::

    OUT/_run.json                the options of this run (resume check)
    OUT/plan.arrow               pack -> tokenized rows -> shard (schemas.plan), before any shard
    OUT/manifest.json            PackManifest: options, inputs' sha256, statistics, oversize, plan
    OUT/pack_stats.arrow         one row per pack (PACK_STATS_SCHEMA), for `prep stats`
    OUT/shards/shard-000000.tar  plain uncompressed tar, >= 1 pack, written via temp + rename
    OUT/shards.json              ShardsManifest, written by `prep shards` after reading all back:
                                 each shard's size and sha256 (`check_shard_files`)
    OUT/.nv-meta/...             added by `prep energon-index` (Energon's own files)

The directory is complete when ``shards.json`` names the plan's sha256 (`read_packed_output`).

Members of one pack, contiguous and sorted by name; key ``pack-NNNNNNNN`` = pack index in
plan order, unique across shards, no dots::

    pack-00000007.img0000.jpg      original encoded bytes of media item 0 (never re-encoded)
    pack-00000007.input_ids.npy    int32 [T]: the samples' input_ids concatenated, no padding
    pack-00000007.json             PackMeta (below)
    pack-00000007.loss_mask.npy    uint8 [T]
    pack-00000007.vid0001.mp4      a video: its whole file; frame_indices say which frames

Tar metadata is fixed (mtime 0, uid/gid 0, empty user/group names, mode 0o644), so the same
input and options give byte-identical shards.

Example ``json`` member (pad_to_multiple_of 8; the pack size is the manifest's, ``pack_size``)::

    {"version": 3, "key": "pack-00000007", "num_tokens": 700,
     "cu_seqlens": [0, 312, 700], "cu_seqlens_padded": [0, 312, 704],
     "samples": [{"input": 0, "sample_id": "chat:17:0", "dataset": "chat",
                  "num_tokens": 312, "media": [0]},
                 {"input": 0, "sample_id": "chat:3:0", "dataset": "chat",
                  "num_tokens": 388, "media": [1]}],
     "media": [{"kind": "image", "ref": "/data/a.jpg", "member": "img0000.jpg",
                "sample": 0, "grid_thw": [1, 32, 32], "num_tokens": 256,
                "frame_indices": [], "timestamps": [], "num_tiles": 1}, ...]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packvlm.errors import DataBudgetError
from schemas.layout import MANIFEST_FILE
from schemas.manifest import (
    SHARDS_MANIFEST_FILE,
    ManifestError,
    PackManifest,
    ShardRecord,
    ShardsManifest,
    file_sha256,
    read_manifest,
)
from schemas.media_ref import MediaRef

PACKED_SCHEMA_VERSION = 3  # 2: media num_tiles; 3: no pack_size (the manifest's is the one copy)
PACKED_READ_VERSIONS = (2, 3)  # pack json and dataset.yaml format_version this code reads
PACKED_FORMAT = "packvlm.packed"
PACK_SUBFLAVORS = {"format": PACKED_FORMAT}  # in dataset.yaml; the shipped cooker matches on it
SHARDS_DIR = "shards"
PACK_STATS_FILE = "pack_stats.arrow"
KEY_PREFIX = "pack-"
META_MEMBER = "json"
INPUT_IDS_MEMBER = "input_ids.npy"
LOSS_MASK_MEMBER = "loss_mask.npy"
TAR_MODE = 0o644
TAR_MTIME = 0
_EXT = re.compile(r"^[a-z0-9]{1,8}$")

PACK_STATS_SCHEMA = pa.schema(
    [
        pa.field("pack", pa.int64(), nullable=False),  # index in plan order = key number
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),  # real tokens
        pa.field("slot_tokens", pa.int32(), nullable=False),  # with pad_to_multiple_of rounding
        pa.field("num_samples", pa.int32(), nullable=False),
        pa.field("num_media", pa.int32(), nullable=False),
    ],
    metadata={"packvlm.schema": "packed.pack_stats", "packvlm.version": "1"},
)


def pack_key(pack_index: int) -> str:
    """Webdataset key of a pack: its plan index, zero-padded so lexical = plan order."""
    return f"{KEY_PREFIX}{pack_index:08d}"


def shard_name(shard_index: int) -> str:
    """File name of a shard under ``SHARDS_DIR``."""
    return f"shard-{shard_index:06d}.tar"


def media_extension(ref: str) -> str:
    """Extension the media member keeps from its source (file or LMDB key); ``bin`` if none."""
    stem, dot, ext = MediaRef.parse(ref).name.rpartition(".")
    ext = ext.lower()
    return ext if dot and stem and _EXT.match(ext) else "bin"


def media_member(kind: str, index: int, ref: str) -> str:
    """Member suffix of media item ``index`` of a pack, e.g. ``img0000.jpg`` / ``vid0001.mp4``."""
    prefix = "img" if kind == "image" else "vid"
    return f"{prefix}{index:04d}.{media_extension(ref)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMedia:
    """One media item of a pack; its bytes are the member ``<key>.<member>``."""

    kind: str  # "image" | "video"
    ref: str  # where tokenize read it: absolute path or "db.lmdb::KEY"
    member: str
    sample: int  # index into PackMeta.samples
    grid_thw: tuple[int, int, int]
    num_tokens: int
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] = ()
    num_tiles: int = 1  # image arrays the processor makes (tiles/crops + global view), v2


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedSampleMeta:
    """One tokenized sample inside a pack; tokens [cu_seqlens[i], cu_seqlens[i+1])."""

    input: int  # index of the tokenized directory in the pack manifest's inputs
    sample_id: str
    dataset: str
    num_tokens: int
    media: tuple[int, ...] = ()  # indices into PackMeta.media


@dataclass(frozen=True, kw_only=True, slots=True)
class PackMeta:
    """The ``json`` member: everything about a pack except its arrays and media bytes."""

    key: str
    num_tokens: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]  # slot boundaries (lengths rounded to pad_to_multiple_of)
    samples: tuple[PackedSampleMeta, ...]
    media: tuple[PackedMedia, ...]
    version: int = PACKED_SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """Plain dict for ``json.dumps`` (hand-built: ``dataclasses.asdict`` deep-copies)."""
        return {
            "version": self.version,
            "key": self.key,
            "num_tokens": self.num_tokens,
            "cu_seqlens": list(self.cu_seqlens),
            "cu_seqlens_padded": list(self.cu_seqlens_padded),
            "samples": [
                {
                    "input": s.input,
                    "sample_id": s.sample_id,
                    "dataset": s.dataset,
                    "num_tokens": s.num_tokens,
                    "media": list(s.media),
                }
                for s in self.samples
            ],
            "media": [
                {
                    "kind": m.kind,
                    "ref": m.ref,
                    "member": m.member,
                    "sample": m.sample,
                    "grid_thw": list(m.grid_thw),
                    "num_tokens": m.num_tokens,
                    "frame_indices": list(m.frame_indices),
                    "timestamps": list(m.timestamps),
                    "num_tiles": m.num_tiles,
                }
                for m in self.media
            ],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PackMeta:
        """Parse a ``json`` member of a version in `PACKED_READ_VERSIONS` (version 2's ``pack_size``,
        the manifest's value repeated, is dropped); refuses others."""
        if raw.get("version") not in PACKED_READ_VERSIONS:
            raise ValueError(
                f"pack json version {raw.get('version')} unsupported; expected one of {PACKED_READ_VERSIONS}"
            )
        if raw["version"] == 2:
            raw = {k: v for k, v in raw.items() if k != "pack_size"} | {"version": PACKED_SCHEMA_VERSION}
        samples = tuple(PackedSampleMeta(**{**s, "media": tuple(s["media"])}) for s in raw["samples"])
        media = tuple(
            PackedMedia(
                **{
                    **m,
                    "grid_thw": tuple(m["grid_thw"]),
                    "frame_indices": tuple(m["frame_indices"]),
                    "timestamps": tuple(m["timestamps"]),
                }
            )
            for m in raw["media"]
        )
        return cls(
            **{
                **raw,
                "cu_seqlens": tuple(raw["cu_seqlens"]),
                "cu_seqlens_padded": tuple(raw["cu_seqlens_padded"]),
                "samples": samples,
                "media": media,
            }
        )


class IncompleteShardsError(ManifestError):
    """The plan exists but its shards are missing or from another plan: run `prep shards`."""


class ShardIntegrityError(DataBudgetError):
    """A shard is not the file `prep shards` wrote (truncated, overwritten, a flipped byte): a data error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedOutput:
    """A complete packed directory: the pack manifest and the shards written from its plan."""

    root: Path
    manifest: PackManifest
    shards: ShardsManifest

    @property
    def shard_paths(self) -> list[Path]:
        return [self.root / s.name for s in self.shards.shards]


def read_packed_output(root: str | Path) -> PackedOutput:
    """Read and cross-check a packed directory's manifests (no shard is opened).

    Raises:
        ManifestError: No pack manifest, another stage's, or an unknown version.
        IncompleteShardsError: The shards were not (all) written from this plan.
    """
    root = Path(root)
    manifest = read_manifest(root / MANIFEST_FILE, PackManifest)
    shards_path = root / SHARDS_MANIFEST_FILE
    if not shards_path.is_file():
        raise IncompleteShardsError(f"{root} has a plan but no {SHARDS_MANIFEST_FILE}: run `prep shards {root}`")
    shards = read_manifest(shards_path, ShardsManifest)
    if shards.plan_sha256 != manifest.plan.sha256:
        raise IncompleteShardsError(
            f"{shards_path} was written from another plan than {root / manifest.plan.name}: run `prep shards {root}`"
        )
    missing = [s.name for s in shards.shards if not (root / s.name).is_file()]
    if missing:
        raise IncompleteShardsError(f"{root}: shards {missing[:3]} are missing; run `prep shards {root}`")
    return PackedOutput(root=root, manifest=manifest, shards=shards)


def shard_difference(root: Path, record: ShardRecord, *, hashes: bool) -> str | None:
    """How the shard ``record`` names differs from what was recorded, or None when it does not.

    Its size always (a stat); its sha256 too with ``hashes`` (reads every byte) when recorded.
    """
    path = root / record.name
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        return "is missing"
    if size != record.bytes:
        return f"is {size:,} bytes, {SHARDS_MANIFEST_FILE} records {record.bytes:,} (truncated or overwritten)"
    if hashes and record.sha256 and file_sha256(path) != record.sha256:
        return f"has another sha256 than {SHARDS_MANIFEST_FILE} records (damaged: a changed byte)"
    return None


def check_shard_files(packed: PackedOutput, *, hashes: bool) -> int:
    """Raise `ShardIntegrityError` naming the first shard that differs from ``shards.json``.

    Sizes are checked always; sha256 only with ``hashes`` and when recorded (version 2).

    Returns:
        How many shards were hashed (0 without ``hashes`` or for a version-1 ``shards.json``).
    """
    for record in packed.shards.shards:
        problem = shard_difference(packed.root, record, hashes=hashes)
        if problem is not None:
            raise ShardIntegrityError(
                f"shard {packed.root / record.name} {problem}: run `prep shards {packed.root}` (it rewrites shards "
                f"that differ from {SHARDS_MANIFEST_FILE}), then `prep energon-index {packed.root}`"
            )
    return sum(1 for r in packed.shards.shards if r.sha256) if hashes else 0


# --- a pack as a loader reads it back (`packvlm.energon` cooks shards into these) ---------


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMediaItem:
    """One media item of a loaded pack: its metadata and its original encoded bytes."""

    meta: PackedMedia
    data: bytes  # the member ``<key>.<meta.member>``, never re-encoded


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LoadedPack:
    """One pack read back from a shard: sample i owns tokens [cu_seqlens[i], cu_seqlens[i+1]).

    Plain data (no loader types), so the code turning packs into model inputs is testable
    on hand-built packs. ``eq=False``: numpy arrays have no truth value.
    """

    meta: PackMeta
    input_ids: np.ndarray  # int32 [T], T = meta.num_tokens
    loss_mask: np.ndarray  # uint8 [T], 1 on tokens to learn
    media: tuple[PackedMediaItem, ...]  # meta.media with their bytes, in token order

    @property
    def key(self) -> str:
        return self.meta.key

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int32 [S+1]: boundaries of the samples' real tokens."""
        return np.asarray(self.meta.cu_seqlens, dtype=np.int32)

    @property
    def cu_seqlens_padded(self) -> np.ndarray:
        """int32 [S+1]: slot boundaries (lengths rounded up to pad_to_multiple_of)."""
        return np.asarray(self.meta.cu_seqlens_padded, dtype=np.int32)

    @property
    def sample_ids(self) -> tuple[str, ...]:
        """Tokenized sample ids, in pack order."""
        return tuple(s.sample_id for s in self.meta.samples)
