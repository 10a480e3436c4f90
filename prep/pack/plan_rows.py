"""The in-memory assignment as `schemas.plan` rows: what `prep shards` reads to write tars."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prep.pack.assignment import PackAssignment
from prep.pack.inputs import SampleColumns, TokenizedInput
from schemas.plan import PackPlan, PlanInput, plan_table


def _global_ids(cols: SampleColumns) -> pa.Array:
    chunks = [chunk for ids in cols.sample_ids for chunk in ids.chunks]
    return pa.chunked_array(chunks, type=pa.string()).combine_chunks() if chunks else pa.array([], pa.string())


def build_plan(
    assignment: PackAssignment,
    cols: SampleColumns,
    inputs: list[TokenizedInput],
    shard_offsets: np.ndarray,
    shard_splits: tuple[str, ...],
) -> pa.Table:
    """One row per packed sample in pack order, packs in key order, with the header attached."""
    items = assignment.item_order
    packs = np.repeat(np.arange(assignment.num_packs, dtype=np.int64), np.diff(assignment.pack_offsets))
    shard_of_pack = np.repeat(np.arange(shard_offsets.size - 1, dtype=np.int32), np.diff(shard_offsets))
    header = PackPlan(
        version=PackPlan.VERSION,
        pack_size=assignment.pack_size,
        pad_to_multiple_of=assignment.pad_to_multiple_of,
        num_packs=assignment.num_packs,
        shard_offsets=tuple(int(o) for o in shard_offsets),
        shard_splits=shard_splits,
        inputs=tuple(
            PlanInput(path=i.root, manifest_sha256=i.manifest_sha256, parts=i.parts, part_rows=i.part_rows)
            for i in inputs
        ),
    )
    columns = {
        "pack": packs,
        "shard": shard_of_pack[packs] if packs.size else np.zeros(0, np.int32),
        "input": cols.input_index[items].astype(np.int32),
        "part": cols.part_index[items].astype(np.int32),
        "row": cols.row[items],
        "num_tokens": cols.num_tokens[items].astype(np.int32),
        "slot_tokens": assignment.slot_lengths[items].astype(np.int32),
        "sample_id": pc.take(_global_ids(cols), pa.array(items, pa.int64())),
    }
    return plan_table(header, columns)
