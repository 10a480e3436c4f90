"""The pack plan: which tokenized rows go into which pack and shard (``OUT/plan.arrow``).

Written by `prep pack` (atomically, before any shard) and read by `prep shards`, which needs
nothing else to write the shards: the header (`PackPlan`, JSON in the schema metadata under
``packvlm.plan``) names the tokenized parts; the table has one row per packed sample, in
pack order, packs in key order::

    pack  shard  input  part  row  num_tokens  slot_tokens  sample_id
    0     0      0      1     17   900         904          "chat:530:0"
    0     0      0      0     3    100         104          "chat:3:0"
    1     0      0      0     8    600         600          "chat:8:0"

``input`` indexes `PackPlan.inputs`, ``part`` that input's ``parts``; ``row`` is the row in
the part. Oversize samples are not in the plan (the pack manifest reports them).

Splits (version 2): packs are assigned to train, val, test in plan order and no shard spans
two splits; ``shard_splits[s]`` names shard s's split. With 5 packs, ``--split-ratio
0.8,0.2,0`` and 2-pack shards: ``shard_offsets (0, 2, 4, 5)``, ``shard_splits ("train",
"train", "val")``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from schemas.codec import ManifestFormatError, from_json, to_json
from schemas.manifest import ManifestError, ManifestVersionError
from schemas.splits import SPLIT_NAMES

PLAN_FILE = "plan.arrow"
PLAN_METADATA_KEY = b"packvlm.plan"

PLAN_SCHEMA = pa.schema(
    [
        pa.field("pack", pa.int64(), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("input", pa.int32(), nullable=False),
        pa.field("part", pa.int32(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("slot_tokens", pa.int32(), nullable=False),  # num_tokens rounded to pad_to_multiple_of
        pa.field("sample_id", pa.string(), nullable=False),
    ],
    metadata={"packvlm.schema": "plan.samples", "packvlm.version": "1"},
)


class PlanError(ManifestError):
    """``plan.arrow`` is missing, unreadable or of another version: rerun `prep pack`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInput:
    """A tokenized directory and its parts (file names under ``samples/``), in order."""

    path: str
    manifest_sha256: str
    parts: tuple[str, ...]
    part_rows: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackPlan:
    """The plan header; rows are in the table."""

    VERSION: ClassVar[int] = 2

    version: int
    pack_size: int
    pad_to_multiple_of: int
    num_packs: int
    shard_offsets: tuple[int, ...]  # shard s holds packs [shard_offsets[s], shard_offsets[s+1])
    shard_splits: tuple[str, ...]  # shard s belongs to split shard_splits[s] (schemas.splits.SPLIT_NAMES)
    inputs: tuple[PlanInput, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shard_offsets) - 1

    def to_json(self) -> dict[str, Any]:
        return dict(to_json(self))

    @classmethod
    def from_json(cls, raw: Any, where: str = "plan") -> PackPlan:
        if not isinstance(raw, dict) or raw.get("version") != cls.VERSION:
            version = raw.get("version") if isinstance(raw, dict) else None
            raise ManifestVersionError(
                f"{where}: plan version {version!r}, this packvlm reads version {cls.VERSION}; rerun `prep pack`"
            )
        try:
            plan = from_json(cls, raw, where)
        except ManifestFormatError as exc:
            raise PlanError(f"malformed plan: {exc}") from exc
        if len(plan.shard_splits) != plan.num_shards or not set(plan.shard_splits) <= set(SPLIT_NAMES):
            raise PlanError(f"malformed plan: {where}: shard_splits must name one of {SPLIT_NAMES} per shard")
        return plan


def slot_tokens(num_tokens: Any, pad_to_multiple_of: int) -> Any:
    """A sample's slot: its length rounded up to ``pad_to_multiple_of`` (ints or numpy arrays)."""
    return -(-num_tokens // pad_to_multiple_of) * pad_to_multiple_of


def plan_table(plan: PackPlan, columns: dict[str, Any]) -> pa.Table:
    """The plan as an Arrow table with its header in the schema metadata."""
    schema = PLAN_SCHEMA.with_metadata(
        {**PLAN_SCHEMA.metadata, PLAN_METADATA_KEY: json.dumps(plan.to_json(), sort_keys=True).encode()}
    )
    return pa.table(columns, schema=schema)


def read_plan(path: str | Path) -> tuple[PackPlan, pa.Table]:
    """Memory-map ``plan.arrow``: its header and its rows."""
    path = Path(path)
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except FileNotFoundError as exc:
        raise PlanError(f"{path} does not exist: run `prep pack` first") from exc
    except (OSError, pa.ArrowInvalid) as exc:
        raise PlanError(f"{path} is unreadable or truncated ({exc}); rerun `prep pack`") from exc
    raw = (table.schema.metadata or {}).get(PLAN_METADATA_KEY)
    if raw is None:
        raise PlanError(f"{path} has no plan header: not written by `prep pack`")
    return PackPlan.from_json(json.loads(raw), str(path)), table
