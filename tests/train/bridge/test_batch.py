"""`train.bridge.bridge_batch` against Megatron-Bridge 0.6.2's real batch code (CPU).

What the main environment cannot import: Bridge's in-batch THD packer
(``data/packing/in_batch.build_mcore_thd_sequence_batch_from_rows``), its VLM step
(``training/vlm_step.get_batch_from_iterator``, ``get_batch``, the visual-keyword filter) and
``training/utils/packed_seq_utils.get_packed_seq_params``. Truths: Bridge packing the same samples
must give the same fields; Bridge's step must hand the model our tensors unchanged (a middle
pipeline stage: no payloads, no labels). ``Tensor.cuda`` is an identity, as in Bridge's own CPU
unit tests. The per-sample row (labels shifted, masked where the shifted assistant mask is 0) is
the rule of Bridge's VLM collate functions (``models/qwen_vl/data/collate_fn.qwen2_5_collate_fn``),
which is inline code there: it is stated here, the packing is Bridge's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip(
        "megatron.bridge is not installed (Python 3.12 env of .ci/bridge-env runs these)", allow_module_level=True
    )

from tests.train.bridge import standins  # noqa: E402

standins.install()

from tests.train.test_bridge import DOC_SAMPLES, PAD, make_batch  # noqa: E402
from train.batch import IGNORE_INDEX  # noqa: E402
from train.bridge import VisualInputs, bridge_batch  # noqa: E402

pytestmark = [
    pytest.mark.bridge,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def collate_row(input_ids: torch.Tensor, assistant_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sample as Bridge's VLM collate makes it before packing (shifted labels and loss mask)."""
    loss_mask = assistant_mask.to(torch.float32)
    labels = torch.cat([input_ids[1:], input_ids.new_full((1,), IGNORE_INDEX)])
    shifted = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])
    return {
        "input_ids": input_ids,
        "position_ids": torch.arange(input_ids.numel()),
        "labels": labels.masked_fill(shifted == 0, IGNORE_INDEX),
        "loss_mask": shifted,
    }


def assert_equals_bridge_packer(ours: dict[str, Any], rows: list[dict[str, torch.Tensor]], multiple: int) -> None:
    """Every field Bridge's packer makes for the same rows, equal (positions: our text row)."""
    from megatron.bridge.data.packing.in_batch import build_mcore_thd_sequence_batch_from_rows

    theirs = build_mcore_thd_sequence_batch_from_rows(rows, pad_token_id=PAD, pad_to_multiple_of=multiple)
    for key in ("input_ids", "labels", "loss_mask", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"):
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    for key in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):  # Bridge emits them for any multiple > 1, we
        unpadded = key.removesuffix("_padded")  # only where they differ: the same boundaries either way
        mine = ours[key] if ours[key] is not None else ours[unpadded]
        assert torch.equal(mine, theirs.get(key, theirs[unpadded])), key
    assert ours["total_tokens"] == theirs["total_tokens"] and ours["attention_mask"] is theirs["attention_mask"]
    text = ours["position_ids"] if ours["position_ids"].dim() == 2 else None
    if text is not None:
        assert torch.equal(text, theirs["position_ids"])


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_equals_bridge_in_batch_packer(multiple):
    samples = [
        ([5, 6, 7, 8, 9, 10, 11], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX, 11]),
        ([12, 13], [IGNORE_INDEX, 13]),
        ([14, 15, 16, 17, 18], [IGNORE_INDEX, IGNORE_INDEX, 16, 17, 18]),
    ]
    ours = bridge_batch(make_batch(samples, multiple))
    rows = [collate_row(torch.tensor(ids), torch.tensor(labels) != IGNORE_INDEX) for ids, labels in samples]
    assert_equals_bridge_packer(ours, rows, multiple)


def test_mistral3_pack_equals_bridge_packer(tmp_path):
    """Real Mistral 3 processor samples (1-D rope, images with image_sizes), packed by us and by Bridge."""
    from families.processor import load_processor
    from tests.train.models import CONVERSATIONS, make_family, pack_samples, process
    from train.encoder import PackEncoder

    family = make_family("mistral3", tmp_path)
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    samples = [process(load_processor(str(family.processor_dir)).processor, c) for c in CONVERSATIONS]
    ours = bridge_batch(encoder.encode(pack_samples(samples, family.processor_dir, pad_to_multiple_of=4)))
    rows = [collate_row(s.input_ids[0], s.loss_mask.bool()) for s in samples]
    assert encoder.pad_token_id is not None
    from megatron.bridge.data.packing.in_batch import build_mcore_thd_sequence_batch_from_rows

    theirs = build_mcore_thd_sequence_batch_from_rows(rows, pad_token_id=encoder.pad_token_id, pad_to_multiple_of=4)
    for key in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_q", "cu_seqlens_q_padded"):
        mine = ours[key] if ours[key] is not None else ours["cu_seqlens_q"]
        assert torch.equal(mine, theirs[key]), key


def _forward_args(batch: dict[str, Any], model_class: type, monkeypatch) -> dict:
    """What vlm_step.forward_step hands ``model(**forward_args)``, through Bridge's real functions.

    One pipeline stage (first and last): without torch.distributed, megatron-core's stage checks
    answer rank 0 of 1 whatever the group.
    """
    from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    from megatron.bridge.training.vlm_step import _filter_visual_kwargs_for_model, get_batch

    moved: list[str] = []

    def cuda(self, non_blocking=False):
        moved.append(type(self).__name__)
        return self

    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    group = SimpleNamespace(pp=None)
    tokens, labels, loss_mask, attention_mask, position_ids, packed, visual = get_batch(
        iter([batch]), SimpleNamespace(dataset=SimpleNamespace()), pg_collection=group
    )
    args = dict(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels,
                loss_mask=loss_mask)  # fmt: skip
    if visual is not None:
        args.update(_filter_visual_kwargs_for_model(model_class, visual.normalized_for_model()))
    if packed is not None:
        args["packed_seq_params"] = get_packed_seq_params(packed)
    monkeypatch.undo()
    args["_moved"] = moved
    return args


def test_vlm_step_hands_the_model_our_batch(monkeypatch):
    """Qwen2.5-VL (mRoPE rows, image grid): every tensor reaches the model's forward, unchanged."""
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel

    vision = {"pixel_values": torch.randn(8, 12), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    batch = dataclasses.replace(make_batch(DOC_SAMPLES, 4, mrope=True), vision=vision)
    out = bridge_batch(batch)
    args = _forward_args(out, Qwen25VLModel, monkeypatch)
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
    from megatron.bridge.training.vlm_step import get_batch_from_iterator

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, non_blocking=False: self)
    middle = get_batch_from_iterator(iter([bridge_batch(batch)]), is_first_pp_stage=False, is_last_pp_stage=False)
    assert middle["labels"] is None and middle["loss_mask"] is None
    fields = middle["visual_inputs"].normalized_for_model()
    assert "pixel_values" not in fields and torch.equal(fields["image_grid_thw"], vision["image_grid_thw"])


def test_vlm_step_keeps_ministral3_image_sizes(monkeypatch):
    from megatron.bridge.models.ministral3.modeling_ministral3 import Ministral3Model

    vision = {"pixel_values": torch.randn(2, 3, 28, 28), "image_sizes": torch.tensor([[28, 28], [28, 14]])}
    out = bridge_batch(dataclasses.replace(make_batch(DOC_SAMPLES, 4), vision=vision))
    args = _forward_args(out, Ministral3Model, monkeypatch)
    assert {"pixel_values", "image_sizes", "packed_seq_params"} <= set(args)
    assert args["image_sizes"] is vision["image_sizes"] and args["position_ids"].shape == (1, 8)


def test_vlm_step_refuses_what_it_cannot_move(monkeypatch):
    """The check is not vacuous: a Python int where Bridge calls .cpu(), a list where it calls .cuda()."""
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel

    out = bridge_batch(make_batch(DOC_SAMPLES, 4))
    with pytest.raises(AttributeError, match="cpu"):
        _forward_args({**out, "max_seqlen_q": 4}, Qwen25VLModel, monkeypatch)
    monkeypatch.undo()
    broken = VisualInputs(pixel_values=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="cuda"):
        _forward_args({**out, "visual_inputs": broken}, Qwen25VLModel, monkeypatch)
