"""Context-parallel slicing of a THD row (`train.context_parallel`) against independent truths.

Truths: hand-computed layouts for known packs; megatron-core's own ``get_batch_on_this_cp_rank``
(pure torch, run per sample with a stand-in CP group); megatron-core's THD entry point
``get_thd_batch_on_this_cp_rank`` with Transformer Engine's index kernel ported line by line to
Python (TE's extension needs CUDA); conservation (the ranks' slices put back are the row).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.batch import IGNORE_INDEX, PackedBatch
from train.bridge import shift_labels
from train.context_parallel import (
    ContextParallelPaddingError,
    padding_problem,
    partition_index,
    slice_for_rank,
    slot_multiple,
)
from train.dataset import TrainConfigError, open_packed_dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed"),
    pytest.mark.filterwarnings("ignore:Apex is not installed"),
]


def row_batch(lengths: list[int], multiple: int, *, mrope: bool = False) -> PackedBatch:
    """A PackedBatch whose token ids are their row position + 100 (so slices read as positions)."""
    slots = [-(-n // multiple) * multiple for n in lengths]
    real, padded = [0], [0]
    for n, s in zip(lengths, slots):
        real.append(real[-1] + n)
        padded.append(padded[-1] + s)
    T = padded[-1]
    ids = torch.arange(T)[None] + 100
    labels = ids.clone()
    text = torch.zeros(1, T, dtype=torch.long)
    for i, (n, s) in enumerate(zip(lengths, slots)):
        labels[0, padded[i]] = IGNORE_INDEX
        labels[0, padded[i] + n : padded[i + 1]] = IGNORE_INDEX
        text[0, padded[i] : padded[i + 1]] = torch.arange(s)
    positions = torch.stack([text, text + 1000, text + 2000, text + 3000]) if mrope else text
    return PackedBatch(
        input_ids=ids,
        labels=labels,
        position_ids=positions,
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=max(slots),
        mm_token_type_ids=torch.zeros(1, T, dtype=torch.long),
    )


def megatron_tensors(batch: PackedBatch) -> dict[str, torch.Tensor]:
    """The per-token tensors a Megatron step slices: shifted labels, loss mask, every position row."""
    labels, loss_mask = shift_labels(batch)
    out = {"tokens": batch.input_ids, "labels": labels, "loss_mask": loss_mask, "position_ids": batch.position_ids}
    if batch.position_ids.dim() == 3:
        out["mrope_position_ids"] = batch.position_ids[1:]
    return out


# -- hand-computed layouts ----------------------------------------------------------------------


def test_docstring_example_two_ranks():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_three_ranks_hand_computed():
    cu = torch.tensor([0, 12, 18], dtype=torch.int32)  # chunks of 2 and 1 tokens
    assert partition_index(cu, 3, 0).tolist() == [0, 1, 10, 11, 12, 17]
    assert partition_index(cu, 3, 1).tolist() == [2, 3, 8, 9, 13, 16]
    assert partition_index(cu, 3, 2).tolist() == [4, 5, 6, 7, 14, 15]


def test_cp_one_keeps_the_row():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert partition_index(cu, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_padded_pack_every_field_hand_computed():
    """Samples of 3 and 6 tokens, --pad-to-multiple-of 4 -> slots 4 and 8, CP 2 (chunks 1 and 2)."""
    batch = row_batch([3, 6], 4, mrope=True)
    # row:    ids 100..111; slot 0 = [100 101 102 PAD103], slot 1 = [104..109 PAD110 PAD111]
    # HF labels  [-100 101 102 -100 | -100 105 106 107 108 109 -100 -100]
    # shifted    [101 102 0 0 | 105 106 107 108 109 0 0 0], mask [1 1 0 0 | 1 1 1 1 1 0 0 0]
    rank0 = slice_for_rank(megatron_tensors(batch), batch.cu_seqlens_padded, 2, 0)
    rank1 = slice_for_rank(megatron_tensors(batch), batch.cu_seqlens_padded, 2, 1)
    # rank 0: slot 0 chunks 0,3 -> positions 0, 3; slot 1 chunks 0,3 -> 4 5, 10 11
    assert rank0["tokens"].tolist() == [[100, 103, 104, 105, 110, 111]]
    assert rank0["labels"].tolist() == [[101, 0, 105, 106, 0, 0]]
    assert rank0["loss_mask"].tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0, 0.0]]
    assert rank0["position_ids"][:, 0].tolist() == [[0, 3, 0, 1, 6, 7]] + [
        [k + off for k in [0, 3, 0, 1, 6, 7]] for off in (1000, 2000, 3000)
    ]
    assert rank0["mrope_position_ids"].shape == (3, 1, 6)
    # rank 1: slot 0 chunks 1,2 -> 1 2; slot 1 chunks 1,2 -> 6 7 8 9
    assert rank1["tokens"].tolist() == [[101, 102, 106, 107, 108, 109]]
    assert rank1["labels"].tolist() == [[102, 0, 107, 108, 109, 0]]
    assert rank1["loss_mask"].tolist() == [[1.0, 0.0, 1.0, 1.0, 1.0, 0.0]]
    assert rank1["mrope_position_ids"][0, 0].tolist() == [1001, 1002, 1002, 1003, 1004, 1005]
    # every label token is on exactly one rank
    assert rank0["loss_mask"].sum() + rank1["loss_mask"].sum() == batch.num_label_tokens


# -- conservation and balance -------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 4),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    data=st.data(),
)
def test_union_of_ranks_is_the_row_and_counts_are_equal(cp, chunks, data):
    unit = slot_multiple(cp)
    slots = [c * unit for c in chunks]
    lengths = [data.draw(st.integers(max(1, s - unit + 1), s)) for s in slots]
    batch = row_batch(lengths, unit, mrope=True)
    tensors = megatron_tensors(batch)
    T = batch.num_tokens
    rebuilt = {k: torch.full_like(v, -7, dtype=v.dtype) for k, v in tensors.items()}
    seen = torch.zeros(T, dtype=torch.long)
    for rank in range(cp):
        index = partition_index(batch.cu_seqlens_padded, cp, rank)
        assert index.numel() == T // cp  # every rank the same number of tokens
        for i, s in enumerate(slots):  # and the same number from every slot
            lo, hi = int(batch.cu_seqlens_padded[i]), int(batch.cu_seqlens_padded[i + 1])
            assert int(((index >= lo) & (index < hi)).sum()) == s // cp
        seen[index] += 1
        part = slice_for_rank(tensors, batch.cu_seqlens_padded, cp, rank)
        for k, v in part.items():
            assert v is not None and v.shape[-1] == T // cp
            rebuilt[k][..., index] = v
    assert seen.tolist() == [1] * T  # a partition of the row
    for k, v in tensors.items():
        assert torch.equal(rebuilt[k], v), k


# -- megatron-core's own functions --------------------------------------------------------------


class _Group:
    """Stand-in CP process group: what megatron-core's get_pg_size / get_pg_rank read."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_equals_megatron_core_per_sequence_split(cp, monkeypatch):
    """megatron-core's get_batch_on_this_cp_rank (pure torch) on each slot alone, concatenated."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # get_pg_size reads the group then
    unit = 2 * cp
    batch = row_batch([5, 2 * unit, 1, unit + 3], unit, mrope=True)
    tensors = megatron_tensors(batch)
    rows = {"tokens": tensors["tokens"], "labels": tensors["labels"], "loss_mask": tensors["loss_mask"]}
    rows |= {f"position_row{j}": batch.position_ids[j] for j in range(4)}  # each [1, T]
    bounds = batch.cu_seqlens_padded.tolist()
    for rank in range(cp):
        ours = slice_for_rank(rows, batch.cu_seqlens_padded, cp, rank)
        pieces: dict[str, list[torch.Tensor]] = {k: [] for k in rows}
        for lo, hi in zip(bounds, bounds[1:]):
            alone = get_batch_on_this_cp_rank({k: v[:, lo:hi].clone() for k, v in rows.items()}, _Group(cp, rank))
            for k, v in alone.items():
                pieces[k].append(v)
        for k in rows:
            assert torch.equal(ours[k], torch.cat(pieces[k], dim=1)), (rank, k)


def _binary_search(target: int, array: list[int], length: int) -> int:
    left, right = 1, length - 1
    while left < right:
        mid = (left + right) // 2
        if array[mid] <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


def te_thd_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int):
    """Transformer Engine's ``thd_partition_indices_kernel`` ported line by line to Python.

    NVIDIA/TransformerEngine@89fcca987d2cbe09f2c72223d893a0cc89955f74,
    transformer_engine/common/fused_attn/thd_utils.cu (the index behind
    ``tex.thd_get_partitioned_indices``); one loop iteration per output token.
    """
    batch = cu_seqlens.numel() - 1
    cu_seqlens_s = []
    for seqlen in cu_seqlens.tolist():
        assert seqlen % (world_size * 2) == 0
        cu_seqlens_s.append(seqlen // world_size)
    output = []
    for token_id in range(total_tokens // world_size):
        seq_id = _binary_search(token_id, cu_seqlens_s, batch + 1)
        seq_len = cu_seqlens_s[seq_id + 1] - cu_seqlens_s[seq_id]
        index = token_id - cu_seqlens_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_seqlens_s[seq_id] * world_size + seq_len // 2 * offset
        output.append(index)
    return torch.tensor(output, dtype=torch.int64)


class _TexPort:
    @staticmethod
    def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
        return te_thd_partitioned_indices(cu_seqlens, total_tokens, world_size, rank)


@pytest.mark.parametrize("cp", [2, 4])
def test_equals_megatron_core_thd_entry_point_with_te_index(cp, monkeypatch):
    """megatron-core's get_thd_batch_on_this_cp_rank, TE's kernel ported to Python for its index."""
    import megatron.core.utils as mcore_utils

    monkeypatch.setattr(mcore_utils, "tex", _TexPort())
    monkeypatch.setattr(mcore_utils, "is_te_min_version", lambda *a, **k: True)
    unit = 2 * cp
    batch = row_batch([unit - 1, 3 * unit, 2, unit], unit)
    tensors = megatron_tensors(batch)
    for rank in range(cp):
        theirs, params = mcore_utils.get_thd_batch_on_this_cp_rank(
            {k: v.clone() for k, v in tensors.items()},
            batch.cu_seqlens,
            batch.cu_seqlens_padded,
            torch.tensor([batch.max_seqlen]),
            cp_size=cp,
            cp_rank=rank,
        )
        ours = slice_for_rank(tensors, batch.cu_seqlens_padded, cp, rank)
        for k in tensors:
            assert torch.equal(ours[k], theirs[k]), (rank, k)
        assert torch.equal(params.cu_seqlens_q_padded, batch.cu_seqlens_padded)  # boundaries stay whole


def test_te_port_is_not_the_code_under_test():
    """The port agrees with the hand layout, so the THD test above compares two implementations."""
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert te_thd_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert te_thd_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


# -- refusals -----------------------------------------------------------------------------------


def test_slot_not_a_multiple_names_slot_and_flag():
    with pytest.raises(ContextParallelPaddingError, match=r"slot 1 holds 6 .*--pad-to-multiple-of 8"):
        partition_index(torch.tensor([0, 8, 14, 22]), 4, 0)


def test_non_token_tensor_and_bad_rank_refused():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens has 2 positions"):
        slice_for_rank({"cu_seqlens": cu}, cu, 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        partition_index(cu, 2, 2)
    assert slice_for_rank({"x": None}, cu, 2, 1) == {"x": None}


def test_padding_problem_names_the_prep_flag():
    assert padding_problem(8, 2) is None and padding_problem(8, 4) is None and padding_problem(1, 1) is None
    message = padding_problem(8, 3)
    assert message is not None and "prep pack --pad-to-multiple-of 6" in message and "--pad-to-multiple-of 8" in message


def test_open_packed_dataset_checks_cp_padding(packed_example):
    unpadded = packed_example(media="images")
    with pytest.raises(TrainConfigError, match=r"prep pack --pad-to-multiple-of 4"):
        open_packed_dataset(unpadded.path, cp_size=2)
    assert open_packed_dataset(unpadded.path, cp_size=1).pad_to_multiple_of == 1
    padded = packed_example(media="images", pad_to_multiple_of=8)
    assert open_packed_dataset(padded.path, cp_size=2).pad_to_multiple_of == 8
    assert open_packed_dataset(padded.path, cp_size=4).pad_to_multiple_of == 8
    with pytest.raises(TrainConfigError, match=r"--pad-to-multiple-of 6"):
        open_packed_dataset(padded.path, cp_size=3)
