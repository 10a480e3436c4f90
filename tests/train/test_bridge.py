"""`train.bridge`: our packs as Megatron-Bridge's ``vlm_step`` batch, checked against Bridge's own code.

Megatron-Bridge cannot be installed here (Python 3.12, transformers <= 5.12), so its contract is
copied from its source at NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a
and used as the oracle:

- ``src/megatron/bridge/training/vlm_step.py``: ``get_batch_from_iterator`` verbatim, ``get_batch``
  and the ``forward_args`` part of ``forward_step`` (GPU moves made identity, as Bridge's own unit
  tests do), the visual-keyword filter against the forward signatures of Bridge's
  ``Qwen25VLModel`` and ``Ministral3Model``;
- ``src/megatron/bridge/training/utils/packed_seq_utils.get_packed_seq_params`` (current-metadata
  branch) building megatron-core's real ``PackedSeqParams``;
- ``src/megatron/bridge/data/packing/in_batch.build_mcore_thd_sequence_batch_from_rows`` and the
  per-sample label / loss-mask rule of its VLM collators (``models/qwen_vl/data/collate_fn``):
  Bridge packing the same samples must give the same fields;
- ``src/megatron/bridge/data/energon/hf_task_encoder.HFEnergonBatch``: the field list.

Other truths: hand-computed shifts for known packs, the tokenized rows, a real tiny Qwen2-VL's
``get_rope_index`` per sample, the real Mistral 3 processor.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterable, Mapping
from copy import copy
from inspect import Parameter, signature
from typing import Any

import pytest
import torch
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from families.processor import load_processor
from tests.shards.oracles import tokenized_rows
from tests.train.models import CONVERSATIONS, make_family, pack_samples, process
from train.batch import IGNORE_INDEX, PackedBatch, concat_batches
from train.bridge import BridgeTaskEncoder, PackedVisualInputs, VisualInputs, bridge_batch, visual_inputs
from train.encoder import PackEncoder

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed"),
    pytest.mark.filterwarnings("ignore:Apex is not installed"),
]

PAD = 0
A0, A1, A2, B0, B1 = 11, 12, 13, 21, 22

# -- the oracle: Megatron-Bridge 067f987, src/megatron/bridge/training/vlm_step.py ----------------

_VISUAL_PAYLOAD_FIELDS = frozenset(("pixel_values", "pixel_values_videos"))
_PACKED_SEQ_DEVICE_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_PACKED_SEQ_HOST_KEYS = ("max_seqlen_q", "max_seqlen_kv")
_PACKED_SEQ_PARAM_KEYS = (*_PACKED_SEQ_DEVICE_KEYS, *_PACKED_SEQ_HOST_KEYS, "total_tokens")


def _unwrap_forward_module(model: Any) -> Any:
    module = model
    seen_ids = set()
    while hasattr(module, "module") and id(module) not in seen_ids:
        seen_ids.add(id(module))
        wrapped = getattr(module, "module")  # noqa: B009 (verbatim)
        if wrapped is None or wrapped is module:
            break
        module = wrapped
    return module


def _filter_visual_kwargs_for_model(model: Any, visual_kwargs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not visual_kwargs:
        return {}
    forward_module = _unwrap_forward_module(model)
    forward = getattr(forward_module, "forward", getattr(forward_module, "__call__", None))  # noqa: B004 (verbatim)
    if forward is None:
        return dict(visual_kwargs)
    try:
        forward_signature = signature(forward)
    except (TypeError, ValueError):
        return dict(visual_kwargs)
    params = forward_signature.parameters.values()
    if any(param.kind == Parameter.VAR_KEYWORD for param in params):
        return dict(visual_kwargs)
    supported_kwargs = {
        name
        for name, param in forward_signature.parameters.items()
        if param.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
    }
    return {key: value for key, value in visual_kwargs.items() if key in supported_kwargs}


def _project_visual_inputs_for_pp_stage(visual_inputs: Any, *, is_first_pp_stage: bool) -> Any:
    if visual_inputs is None or is_first_pp_stage:
        return visual_inputs
    projected = copy(visual_inputs)
    for field_name in _VISUAL_PAYLOAD_FIELDS:
        if hasattr(projected, field_name):
            setattr(projected, field_name, None)
    return projected


def get_batch_from_iterator(
    data_iterator: Iterable,
    use_mtp: bool = False,
    skip_getting_attention_mask_from_dataset: bool = True,
    *,
    is_first_pp_stage: bool,
    is_last_pp_stage: bool,
) -> dict[str, Any]:
    batch = next(data_iterator)
    required_device_keys = set()
    required_host_keys = set()
    if not skip_getting_attention_mask_from_dataset:
        required_device_keys.add("attention_mask")
    required_device_keys.add("visual_inputs")
    if "cu_seqlens_q" in batch:
        required_device_keys.update(key for key in _PACKED_SEQ_DEVICE_KEYS if key in batch)
        required_host_keys.update(key for key in _PACKED_SEQ_HOST_KEYS if key in batch)
    required_device_keys.update(("tokens", "input_ids", "position_ids"))
    if is_last_pp_stage:
        required_device_keys.update(("labels", "loss_mask"))
    _batch_required_keys = {}
    for key, val in batch.items():
        if key in required_device_keys:
            if key == "visual_inputs":
                if val is None:
                    _batch_required_keys[key] = None
                else:
                    _batch_required_keys[key] = _project_visual_inputs_for_pp_stage(
                        val,
                        is_first_pp_stage=is_first_pp_stage,
                    )
                    for k, v in _batch_required_keys[key].__dict__.items():
                        _batch_required_keys[key].__dict__[k] = v.cuda(non_blocking=True) if v is not None else None
            else:
                _batch_required_keys[key] = val.cuda(non_blocking=True) if val is not None else None
        elif key in required_host_keys:
            _batch_required_keys[key] = val.cpu() if val is not None else None
        else:
            _batch_required_keys[key] = None
    return _batch_required_keys


def bridge_get_batch(data_iterator: Iterable, *, first: bool = True, last: bool = True) -> tuple:
    """vlm_step.get_batch without cfg / process groups (their only use is the two stage flags)."""
    batch = get_batch_from_iterator(data_iterator, False, True, is_first_pp_stage=first, is_last_pp_stage=last)
    return (
        (batch.get("tokens") if batch.get("tokens") is not None else batch.get("input_ids")),
        batch.get("labels"),
        batch.get("loss_mask"),
        batch.get("attention_mask"),
        batch.get("position_ids"),
        {key: batch[key] for key in _PACKED_SEQ_PARAM_KEYS if batch.get(key) is not None}
        if batch.get("cu_seqlens_q") is not None
        else None,
        batch.get("visual_inputs"),
    )


def get_packed_seq_params(batch: dict[str, Any]) -> Any:
    """packed_seq_utils.get_packed_seq_params, the current-metadata ("cu_seqlens_q") branch.

    ``total_tokens`` / ``cp_partition_mode`` are passed only where the installed megatron-core's
    PackedSeqParams has them (0.16.1 has neither; Bridge targets newer megatron-core).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    def squeeze(value):
        return value.squeeze() if isinstance(value, torch.Tensor) else value

    def as_int(value):
        value = squeeze(value)
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError("max_seqlen must contain exactly one value")
            return int(value.item())
        return int(value)

    cu_seqlens_q = squeeze(batch["cu_seqlens_q"])
    cu_seqlens_kv = squeeze(batch.get("cu_seqlens_kv"))
    max_seqlen_q = as_int(batch.get("max_seqlen_q"))
    max_seqlen_kv = as_int(batch.get("max_seqlen_kv"))
    extra = {"total_tokens": batch.get("total_tokens")} if hasattr(PackedSeqParams, "total_tokens") else {}
    return PackedSeqParams(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q,
        cu_seqlens_q_padded=squeeze(batch.get("cu_seqlens_q_padded")),
        cu_seqlens_kv_padded=squeeze(batch.get("cu_seqlens_kv_padded")),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv if max_seqlen_kv is not None else max_seqlen_q,
        qkv_format="thd",
        **extra,
    )


def bridge_forward_args(batch: dict[str, Any], model: Any, monkeypatch, **stages: bool) -> dict[str, Any]:
    """What vlm_step.forward_step hands ``model(**forward_args)`` for this batch (CPU stands for CUDA)."""
    moved: list[str] = []

    def cuda(self, non_blocking=False):  # Bridge's own unit tests make .cuda() an identity on CPU
        moved.append(type(self).__name__)
        return self

    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    tokens, labels, loss_mask, attention_mask, position_ids, packed, visual = bridge_get_batch(iter([batch]), **stages)
    forward_args = {
        "input_ids": tokens,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "loss_mask": loss_mask,
    }
    if visual is not None:
        forward_args.update(_filter_visual_kwargs_for_model(model, visual.normalized_for_model()))
    if packed is not None:
        forward_args["packed_seq_params"] = get_packed_seq_params(packed)
    monkeypatch.undo()
    forward_args["_moved"] = moved
    return forward_args


class Qwen25VLForward(torch.nn.Module):
    """The forward signature of Bridge's Qwen25VLModel (models/qwen_vl/modeling_qwen25_vl.py)."""

    def forward(  # noqa: PLR0913
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        pixel_values=None,
        pixel_values_videos=None,
        image_grid_thw=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        mm_token_type_ids=None,
        labels=None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs=None,
        runtime_gather_output=None,
        *,
        inference_params=None,
        loss_mask=None,
    ):
        raise NotImplementedError


class Ministral3Forward(torch.nn.Module):
    """The forward signature of Bridge's Ministral3Model (models/ministral3/modeling_ministral3.py)."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        pixel_values=None,
        labels=None,
        runtime_gather_output=None,
        image_sizes=None,
        packed_seq_params=None,
        *,
        loss_mask=None,
    ):
        raise NotImplementedError


#: data/energon/hf_task_encoder.HFEnergonBatch fields that its encode_batch keeps (meta keys popped)
HF_ENERGON_BATCH_FIELDS = {
    "input_ids",
    "labels",
    "loss_mask",
    "position_ids",
    "visual_inputs",
    "attention_mask",
    "padding_mask",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "total_tokens",
}


# -- the oracle: Bridge's in-batch THD packer (data/packing/in_batch.py) and collate label rule ----


def bridge_sample_row(input_ids: torch.Tensor, assistant_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sample as models/qwen_vl/data/collate_fn._prepare_qwen_vl_sequence makes it (shifted)."""
    loss_mask = assistant_mask.to(torch.float32)
    labels = torch.cat([input_ids[1:], input_ids.new_full((1,), IGNORE_INDEX)])
    shifted_loss_mask = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])
    return {
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.numel(), dtype=torch.long),
        "labels": labels.masked_fill(shifted_loss_mask == 0, IGNORE_INDEX),
        "loss_mask": shifted_loss_mask,
    }


def bridge_pack_rows(rows: list[dict[str, torch.Tensor]], *, pad_token_id: int, pad_to_multiple_of: int) -> dict:
    """build_mcore_thd_sequence_batch_from_rows(emit_padding_mask=True), validation left out."""
    unpadded = [row["input_ids"].numel() for row in rows]
    padded_lengths = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in unpadded]
    cu, cu_padded = [0], [0]
    for n, p in zip(unpadded, padded_lengths):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + p)
    total = cu_padded[-1]
    first = rows[0]
    packed: dict[str, Any] = {
        "input_ids": torch.full((1, total), pad_token_id, dtype=first["input_ids"].dtype),
        "position_ids": torch.zeros((1, total), dtype=first["position_ids"].dtype),
        "attention_mask": None,
        "padding_mask": torch.ones((1, total), dtype=torch.bool),
    }
    pad_values = {"labels": IGNORE_INDEX, "loss_mask": 0}
    for key, value in pad_values.items():
        packed[key] = torch.full((1, total), value, dtype=first[key].dtype)
    offset = 0
    for row, length, padded_length in zip(rows, unpadded, padded_lengths):
        packed["input_ids"][0, offset : offset + length] = row["input_ids"]
        packed["position_ids"][0, offset : offset + length] = row["position_ids"]
        packed["padding_mask"][0, offset : offset + length] = False
        for key in pad_values:
            packed[key][0, offset : offset + length] = row[key]
        pad_length = padded_length - length
        if pad_length > 0:
            start = row["position_ids"][-1] + 1
            packed["position_ids"][0, offset + length : offset + padded_length] = torch.arange(
                start, start + pad_length
            )
        offset += padded_length
    cu_t = torch.tensor(cu, dtype=torch.int32)
    packed["cu_seqlens_q"] = packed["cu_seqlens_kv"] = cu_t
    if padded_lengths != unpadded:
        packed["cu_seqlens_q_padded"] = packed["cu_seqlens_kv_padded"] = torch.tensor(cu_padded, dtype=torch.int32)
    packed["max_seqlen_q"] = torch.tensor(max(padded_lengths), dtype=torch.int32)
    packed["max_seqlen_kv"] = torch.tensor(max(padded_lengths), dtype=torch.int32)
    packed["total_tokens"] = total
    return packed


def assert_equals_bridge_packer(ours: dict[str, Any], theirs: dict[str, Any], *, text_positions: torch.Tensor) -> None:
    """Every field Bridge's packer makes, equal (the positions compared: the text row)."""
    for key in ("input_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens_q", "cu_seqlens_kv"):
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    for key in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if key in theirs:
            assert torch.equal(ours[key], theirs[key]), key
        else:
            assert ours[key] is None, key
    for key in ("max_seqlen_q", "max_seqlen_kv"):
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape == ()
        assert int(ours[key]) == int(theirs[key])
    assert ours["total_tokens"] == theirs["total_tokens"] and ours["attention_mask"] is theirs["attention_mask"] is None
    assert torch.equal(text_positions, theirs["position_ids"])


# -- helpers -------------------------------------------------------------------------------------


def make_batch(samples: list[tuple[list[int], list[int]]], multiple: int = 1, *, mrope: bool = False) -> PackedBatch:
    """A PackedBatch the slow, obvious way: (input_ids, HF labels) per sample, slots padded."""
    ids, labels, pos, real, padded = [], [], [], [0], [0]
    for tokens, sample_labels in samples:
        slot = -(-len(tokens) // multiple) * multiple
        ids += tokens + [PAD] * (slot - len(tokens))
        labels += sample_labels + [IGNORE_INDEX] * (slot - len(tokens))
        pos += list(range(slot))
        real.append(real[-1] + len(tokens))
        padded.append(padded[-1] + slot)
    text = torch.tensor([pos])
    return PackedBatch(
        input_ids=torch.tensor([ids]),
        labels=torch.tensor([labels]),
        position_ids=torch.stack([text, text + 100, text + 200, text + 300]) if mrope else text,
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(padded, padded[1:])),
        mm_token_type_ids=torch.zeros(1, len(ids), dtype=torch.long),
    )


DOC_SAMPLES = [([A0, A1, A2], [IGNORE_INDEX, A1, A2]), ([B0, B1], [IGNORE_INDEX, B1])]


def check_contract(out: dict[str, Any], T: int, num_samples: int, *, mrope: bool) -> None:
    """Names, kinds, dtypes, shapes and devices as Bridge's source declares them."""
    assert set(out) == HF_ENERGON_BATCH_FIELDS
    spec = {
        "input_ids": (torch.int64, (1, T)),
        "labels": (torch.int64, (1, T)),
        "loss_mask": (torch.float32, (1, T)),
        "position_ids": (torch.int64, (3, 1, T) if mrope else (1, T)),
        "padding_mask": (torch.bool, (1, T)),
        "cu_seqlens_q": (torch.int32, (num_samples + 1,)),
        "cu_seqlens_kv": (torch.int32, (num_samples + 1,)),
        "max_seqlen_q": (torch.int32, ()),
        "max_seqlen_kv": (torch.int32, ()),
    }
    for key, (dtype, shape) in spec.items():
        value = out[key]
        assert isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == shape, key
        assert value.device.type == "cpu", key  # the loader's tensors; vlm_step moves them
    for key in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = out[key]
        assert value is None or (value.dtype == torch.int32 and tuple(value.shape) == (num_samples + 1,)), key
    assert out["attention_mask"] is None
    assert isinstance(out["total_tokens"], int) and out["total_tokens"] == T
    visual = out["visual_inputs"]
    assert callable(visual.normalized_for_model)
    assert all(v is None or isinstance(v, torch.Tensor) for v in vars(visual).values())


# -- hand-computed packs -------------------------------------------------------------------------


def test_docstring_pack_hand_computed():
    out = bridge_batch(make_batch(DOC_SAMPLES, 4))
    check_contract(out, 8, 2, mrope=False)
    assert out["input_ids"].tolist() == [[A0, A1, A2, PAD, B0, B1, PAD, PAD]]
    assert out["labels"].tolist() == [[A1, A2, -100, -100, B1, -100, -100, -100]]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert out["padding_mask"].tolist() == [[False, False, False, True, False, False, True, True]]
    assert out["cu_seqlens_q"].tolist() == [0, 3, 5] and out["cu_seqlens_q_padded"].tolist() == [0, 4, 8]
    assert out["cu_seqlens_kv"] is out["cu_seqlens_q"] and out["cu_seqlens_kv_padded"] is out["cu_seqlens_q_padded"]
    assert int(out["max_seqlen_q"]) == int(out["max_seqlen_kv"]) == 4
    assert out["total_tokens"] == 8 and out["attention_mask"] is None
    assert isinstance(out["visual_inputs"], VisualInputs) and out["visual_inputs"].normalized_for_model() == {}


def test_unpadded_twin_has_no_padded_boundaries():
    out = bridge_batch(make_batch(DOC_SAMPLES))
    assert out["labels"].tolist() == [[A1, A2, -100, B1, -100]]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 0]]
    assert (
        out["cu_seqlens_q_padded"] is None and out["cu_seqlens_kv_padded"] is None
    )  # as Bridge: only when they differ
    assert out["padding_mask"].tolist() == [[False] * 5] and int(out["max_seqlen_q"]) == 3


def test_boundary_is_structural_even_with_unmasked_first_labels():
    """A batch whose samples' first labels were left unmasked: b0 is still no target of a2."""
    out = bridge_batch(make_batch([([A0, A1, A2], [A0, A1, A2]), ([B0, B1], [B0, B1])]))
    assert out["labels"].tolist() == [[A1, A2, -100, B1, -100]]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 0]]


def test_two_packs_joined_prompt_masked_and_mrope_rows():
    """--packs-per-microbatch 2: pack boundaries are sample boundaries; prompt tokens carry no target."""
    first = make_batch([([1, 2, 3, 4, 5], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4, 5])], 4, mrope=True)
    second = make_batch([([6, 7], [IGNORE_INDEX, 7]), ([8, 9, 10], [IGNORE_INDEX, IGNORE_INDEX, 10])], 4, mrope=True)
    row = concat_batches([first, second], joins={})
    out = bridge_batch(row)
    check_contract(out, 16, 3, mrope=True)
    # slots: [1 2 3 4 5 P P P | 6 7 P P | 8 9 10 P]
    assert out["labels"].tolist() == [
        [-100, -100, 4, 5, -100, -100, -100, -100, 7, -100, -100, -100, -100, 10] + [-100] * 2
    ]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]]
    assert torch.equal(out["position_ids"], row.position_ids[1:])  # the t/h/w rows, text row dropped
    assert out["position_ids"][0, 0, :8].tolist() == [100 + k for k in range(8)]
    assert out["cu_seqlens_q"].tolist() == [0, 5, 7, 10] and out["cu_seqlens_q_padded"].tolist() == [0, 8, 12, 16]
    assert int(out["max_seqlen_q"]) == 8
    assert out["loss_mask"].sum() == row.num_label_tokens


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_equals_bridge_in_batch_packer(multiple):
    samples = [
        ([5, 6, 7, 8, 9, 10, 11], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX, 11]),
        ([12, 13], [IGNORE_INDEX, 13]),
        ([14, 15, 16, 17, 18], [IGNORE_INDEX, IGNORE_INDEX, 16, 17, 18]),
    ]
    ours = bridge_batch(make_batch(samples, multiple))
    rows = [bridge_sample_row(torch.tensor(ids), torch.tensor(labels) != IGNORE_INDEX) for ids, labels in samples]
    theirs = bridge_pack_rows(rows, pad_token_id=PAD, pad_to_multiple_of=multiple)
    assert_equals_bridge_packer(ours, theirs, text_positions=ours["position_ids"])


def test_vlm_step_accepts_the_batch(monkeypatch):
    batch = make_batch(DOC_SAMPLES, 4, mrope=True)
    vision = {"pixel_values": torch.randn(8, 12), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    batch = dataclasses.replace(batch, vision=vision)
    out = bridge_batch(batch)
    args = bridge_forward_args(out, Qwen25VLForward(), monkeypatch, first=True, last=True)
    assert sorted(args) == sorted(
        ["_moved", "input_ids", "position_ids", "attention_mask", "labels", "loss_mask"]
        + ["pixel_values", "image_grid_thw", "packed_seq_params"]
    )
    for key in ("input_ids", "labels", "loss_mask", "position_ids"):
        assert args[key] is out[key]
    assert args["pixel_values"] is vision["pixel_values"] and args["image_grid_thw"] is vision["image_grid_thw"]
    # moved: input_ids, position_ids, labels, loss_mask, 2 cu_seqlens, 2 padded, 2 visual tensors
    assert len(args["_moved"]) == 10
    params = args["packed_seq_params"]
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.cu_seqlens_kv_padded.tolist() == [0, 4, 8]
    # a middle pipeline stage: no payloads, no labels; grids stay for mRoPE
    middle = bridge_forward_args(bridge_batch(batch), Qwen25VLForward(), monkeypatch, first=False, last=False)
    assert middle["labels"] is None and "pixel_values" not in middle and "image_grid_thw" in middle


def test_vlm_step_refuses_what_it_cannot_move(monkeypatch):
    """The oracle is not vacuous: a Python int where Bridge calls .cpu(), a list where it calls .cuda()."""
    out = bridge_batch(make_batch(DOC_SAMPLES, 4))
    with pytest.raises(AttributeError, match="cpu"):
        bridge_forward_args({**out, "max_seqlen_q": 4}, Qwen25VLForward(), monkeypatch)
    monkeypatch.undo()
    broken = VisualInputs(pixel_values=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="cuda"):
        bridge_forward_args({**out, "visual_inputs": broken}, Qwen25VLForward(), monkeypatch)


def test_visual_inputs_container():
    five = torch.randn(1, 2, 3, 4, 4)
    grids = torch.tensor([[[1, 2, 2], [1, 2, 2]]])
    vi = visual_inputs({"pixel_values": five, "image_grid_thw": grids})
    norm = vi.normalized_for_model()  # Bridge's flattening of Qwen-style batched tensors
    assert norm["pixel_values"].shape == (2, 3, 4, 4) and norm["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    flat = visual_inputs({"pixel_values": torch.randn(6, 12), "image_sizes": torch.tensor([[28, 28]])})
    assert set(flat.normalized_for_model()) == {"pixel_values", "image_sizes"}
    extra = visual_inputs({"pixel_values": five, "pixel_attention_mask": torch.ones(1, 2, 4, 4, dtype=torch.bool)})
    assert isinstance(extra, PackedVisualInputs) and set(extra.as_model_kwargs()) == {
        "pixel_values",
        "pixel_attention_mask",
    }
    assert pickle.loads(pickle.dumps(extra)).pixel_attention_mask.shape == (1, 2, 4, 4)  # loader workers pickle it
    with pytest.raises(ValueError, match="audio_values"):
        visual_inputs({"audio_values": torch.zeros(1)})


# -- real packs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def padded(packed_example):
    return packed_example(media="images", pad_to_multiple_of=8)


def _bridge_loader(path, task_encoder, micro_batch_size: int) -> list:
    """What EnergonMultiModalDataModule.train_dataloader iterates (base_energon_datamodule.py):
    get_train_dataset(path, batch_size=micro_batch_size, task_encoder=..., worker_config=...,
    packing_buffer_size=None, split_part="train", shuffle_buffer_size=..., max_samples_per_sequence=None)
    in get_savable_loader; no shuffle and repeat=False here so the run ends and the order is known."""
    dataset = get_train_dataset(
        path,
        batch_size=micro_batch_size,
        task_encoder=task_encoder,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1),
        packing_buffer_size=None,
        split_part="train",
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    return list(get_savable_loader(dataset))


def test_example_packs_through_bridge_datamodule_loader(padded, monkeypatch):
    """Qwen2-VL example packs (--pad-to-multiple-of 8), 2 packs per micro-batch, through Energon in a worker."""
    task_encoder = BridgeTaskEncoder(str(padded.processor), str(padded.processor))
    batches = _bridge_loader(padded.path, task_encoder, micro_batch_size=2)
    reference = _bridge_loader(padded.path, task_encoder.packs, micro_batch_size=2)  # PackedBatch, same hooks
    assert len(batches) == len(reference) >= 3
    rows = tokenized_rows(padded.tokenized)
    pad_id = task_encoder.packs.encoder.pad_token_id
    ids_cfg = AutoConfig.from_pretrained(str(padded.processor))
    config = AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2),
        image_token_id=ids_cfg.image_token_id, video_token_id=ids_cfg.video_token_id,
    )  # fmt: skip
    model = MODEL_MAPPING[type(config)](config)  # a real tiny Qwen2-VL: its get_rope_index is the truth
    images = 0
    for out, packed in zip(batches, reference):
        T, S = packed.num_tokens, packed.num_samples
        check_contract(out, T, S, mrope=True)
        assert torch.equal(out["input_ids"], packed.input_ids)
        floats = packed.vision_inputs()  # our loader's uint8 pixels, made float: Bridge's encoder ships floats
        assert vars(out["visual_inputs"]).keys() >= floats.keys()
        for key, value in vars(out["visual_inputs"]).items():  # attributes == PackedBatch.vision
            assert torch.equal(value, floats[key]) if key in floats else value is None, key
        # Bridge's packer on the tokenized rows (not on our batch) gives every other field
        bridge_rows, grids = [], iter(packed.image_grid_thw if packed.image_grid_thw is not None else [])
        for i, sample_id in enumerate(packed.sample_ids):
            row = rows[sample_id]
            ids = torch.tensor(row["input_ids"])
            bridge_rows.append(bridge_sample_row(ids, torch.tensor(row["loss_mask"]).bool()))
            start, n = int(packed.cu_seqlens_padded[i]), ids.numel()
            mine = [next(grids) for _ in row["media"]]
            images += len(mine)
            alone, _ = model.get_rope_index(
                ids[None], mm_token_type_ids=(ids[None] == config.image_token_id).long(),
                image_grid_thw=torch.stack(mine) if mine else None,
            )  # fmt: skip
            assert torch.equal(out["position_ids"][:, :, start : start + n], alone)  # per-sample mRoPE rows
        theirs = bridge_pack_rows(bridge_rows, pad_token_id=pad_id, pad_to_multiple_of=8)
        assert_equals_bridge_packer(out, theirs, text_positions=packed.position_ids[0])
        args = bridge_forward_args(out, Qwen25VLForward(), monkeypatch)
        assert torch.equal(args["packed_seq_params"].cu_seqlens_q_padded, packed.cu_seqlens_padded)
        assert ("pixel_values" in args) == (packed.pixel_values is not None)
    assert images >= 4


def test_task_encoder_pickles_without_processors(padded):
    task_encoder = BridgeTaskEncoder(str(padded.processor), str(padded.processor))
    assert task_encoder.packs.encoder is not None  # built
    clone = pickle.loads(pickle.dumps(task_encoder))
    assert clone.packs._encoder is None and clone.packs.processor == str(padded.processor)


def test_mistral3_pack_one_dimensional_rope_and_image_sizes(tmp_path, monkeypatch):
    """A 1-D rope family (Bridge's Ministral 3 recipe): [1, T] positions, pixel_values + image_sizes kept."""
    family = make_family("mistral3", tmp_path)
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    samples = [process(load_processor(str(family.processor_dir)).processor, c) for c in CONVERSATIONS]
    batch = encoder.encode(pack_samples(samples, family.processor_dir, pad_to_multiple_of=4))
    out = bridge_batch(batch)
    check_contract(out, batch.num_tokens, len(samples), mrope=False)
    assert encoder.media.layout.rope != "mrope" and out["position_ids"] is batch.position_ids
    for i, s in enumerate(samples):
        start, slot = int(batch.cu_seqlens_padded[i]), int(batch.cu_seqlens_padded[i + 1] - batch.cu_seqlens_padded[i])
        assert out["position_ids"][0, start : start + slot].tolist() == list(range(slot))
        assert torch.equal(out["input_ids"][0, start : start + s.input_ids.shape[1]], s.input_ids[0])
    assert set(vars(out["visual_inputs"])) >= {"pixel_values", "image_sizes"}
    assert torch.equal(out["visual_inputs"].pixel_values, batch.pixel_values)
    assert torch.equal(out["visual_inputs"].image_sizes, batch.vision["image_sizes"])
    assert out["visual_inputs"].image_sizes.shape[0] == sum(len(c.image_sizes) for c in CONVERSATIONS)
    rows = [bridge_sample_row(s.input_ids[0], s.loss_mask.bool()) for s in samples]
    theirs = bridge_pack_rows(rows, pad_token_id=encoder.pad_token_id, pad_to_multiple_of=4)
    assert_equals_bridge_packer(out, theirs, text_positions=out["position_ids"])
    args = bridge_forward_args(out, Ministral3Forward(), monkeypatch)
    assert {"pixel_values", "image_sizes", "packed_seq_params"} <= set(args)
