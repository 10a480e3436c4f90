"""`train.bridge`: our packs as Megatron-Bridge's ``vlm_step`` batch, checked without Bridge.

Megatron-Bridge cannot be installed in the main environment (Python 3.12 only, transformers
<= 5.12.1). What needs Bridge's own code (its in-batch packer, ``vlm_step``, ``get_packed_seq_params``,
its dataset build, its models) is tested against that code in ``tests/train/bridge/`` (marker
``bridge``, the Python 3.12 environment of ``.ci/bridge-env``). Here, truths that need no copy of
Bridge: hand-computed shifts for known packs, the tokenized rows, a real tiny Qwen2-VL's
``get_rope_index`` per sample, the real Mistral 3 processor.
"""

from __future__ import annotations

import pickle
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


#: the fields bridge_batch hands Bridge's vlm_step (its HFEnergonBatch's, plus padding_mask)
BATCH_FIELDS = {
    "input_ids", "labels", "loss_mask", "position_ids", "visual_inputs", "attention_mask", "padding_mask",
    "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
    "total_tokens",
}  # fmt: skip
DOC_SAMPLES = [([A0, A1, A2], [IGNORE_INDEX, A1, A2]), ([B0, B1], [IGNORE_INDEX, B1])]


def check_contract(out: dict[str, Any], T: int, num_samples: int, *, mrope: bool) -> None:
    """Names, kinds, dtypes, shapes and devices as Bridge's source declares them."""
    assert set(out) == BATCH_FIELDS
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


def test_example_packs_through_bridge_datamodule_loader(padded):
    """Qwen2-VL example packs (--pad-to-multiple-of 8), 2 packs per micro-batch, through Energon in a worker."""
    task_encoder = BridgeTaskEncoder(str(padded.processor), str(padded.processor))
    batches = _bridge_loader(padded.path, task_encoder, micro_batch_size=2)
    reference = _bridge_loader(padded.path, task_encoder.packs, micro_batch_size=2)  # PackedBatch, same hooks
    assert len(batches) == len(reference) >= 3
    rows = tokenized_rows(padded.tokenized)
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
        # the tokenized rows (not our batch) give every other field; per-sample mRoPE rows from the HF model
        grids = iter(packed.image_grid_thw if packed.image_grid_thw is not None else [])
        for i, sample_id in enumerate(packed.sample_ids):
            row = rows[sample_id]
            ids = torch.tensor(row["input_ids"])
            start, n = int(packed.cu_seqlens_padded[i]), ids.numel()
            assert torch.equal(out["input_ids"][0, start : start + n], ids)
            shifted = torch.cat([torch.tensor(row["loss_mask"][1:], dtype=torch.float32), torch.zeros(1)])  # t -> t+1
            assert torch.equal(out["loss_mask"][0, start : start + n], shifted)
            targets = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)]).masked_fill(shifted == 0, IGNORE_INDEX)
            assert torch.equal(out["labels"][0, start : start + n], targets)
            mine = [next(grids) for _ in row["media"]]
            images += len(mine)
            alone, _ = model.get_rope_index(
                ids[None], mm_token_type_ids=(ids[None] == config.image_token_id).long(),
                image_grid_thw=torch.stack(mine) if mine else None,
            )  # fmt: skip
            assert torch.equal(out["position_ids"][:, :, start : start + n], alone)  # per-sample mRoPE rows
        assert torch.equal(out["cu_seqlens_q_padded"], packed.cu_seqlens_padded)
        assert int(out["padding_mask"].sum()) == T - int(packed.cu_seqlens[-1])  # the slots' padding
    assert images >= 4


def test_task_encoder_pickles_without_processors(padded):
    task_encoder = BridgeTaskEncoder(str(padded.processor), str(padded.processor))
    assert task_encoder.packs.encoder is not None  # built
    clone = pickle.loads(pickle.dumps(task_encoder))
    assert clone.packs._encoder is None and clone.packs.processor == str(padded.processor)


def test_mistral3_pack_one_dimensional_rope_and_image_sizes(tmp_path):
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
    for i, s in enumerate(samples):  # shifted targets, masked outside the assistant turns
        start, n = int(batch.cu_seqlens_padded[i]), s.input_ids.shape[1]
        shifted = torch.cat([s.loss_mask[1:].float(), torch.zeros(1)])
        assert torch.equal(out["loss_mask"][0, start : start + n], shifted)
