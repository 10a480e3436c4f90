"""Megatron-Bridge's VLM batch from our packs: a task encoder for ``EnergonMultiModalDataModule``.

Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge, source read at 067f987) trains VLMs with
``training/vlm_step.forward_step``. Its ``get_batch_from_iterator`` takes ``next(iterator)`` as a
dict, moves ``input_ids`` / ``tokens``, ``position_ids``, ``labels``, ``loss_mask``, every tensor
attribute of ``visual_inputs`` and the ``cu_seqlens_*`` to the GPU, calls ``.cpu()`` on
``max_seqlen_q/kv`` and sets every other key to None; ``forward_step`` then builds
``PackedSeqParams`` (qkv_format "thd") from the ``cu_seqlens*`` / ``max_seqlen*`` keys and passes
``visual_inputs.normalized_for_model()`` to the model as keywords. `BridgeTaskEncoder` yields
exactly the dict Bridge's own ``data/energon/hf_task_encoder.HFTaskEncoder.encode_batch`` yields
(the fields of ``HFEnergonBatch``, laid out as its in-batch packer
``data/packing/in_batch.build_mcore_thd_sequence_batch_from_rows`` lays them out), from a
`train.batch.PackedBatch` built by `train.encoder.PackEncoder`. For the `train.batch` docstring
row (samples of 3 and 2 tokens, ``--pad-to-multiple-of 4``, T = 8)::

    input_ids             int64   [1, T]     [a0 a1 a2 PAD | b0 b1 PAD PAD]
    labels                int64   [1, T]     [a1 a2 -100 -100 | b1 -100 -100 -100]   pre-shifted
    loss_mask             float32 [1, T]     [1 1 0 0 | 1 0 0 0]
    position_ids          int64   [3, 1, T]  t/h/w mRoPE rows of each sample alone (Qwen-VL, GLM)
                          int64   [1, T]     [0 1 2 3 | 0 1 2 3]  (families with 1-D rope)
    visual_inputs         GenericVisualInputs(pixel_values=..., image_grid_thw=...) = PackedBatch.vision
    attention_mask        None
    padding_mask          bool    [1, T]     [F F F T | F F T T]   True on slot padding
    cu_seqlens_q / _kv    int32   [S+1]      [0 3 5]
    cu_seqlens_q_padded / _kv_padded  int32 [S+1]  [0 4 8]   (None when equal to cu_seqlens)
    max_seqlen_q / _kv    int32   []         tensor(4)            the longest slot
    total_tokens          int                8

Why each choice (all as Bridge does it):

- ``labels[t]`` is the target of position ``t`` (the Hugging Face label at ``t + 1``, via
  `shift_labels`) and ``-100`` wherever ``loss_mask`` is 0, as Bridge's
  collators write them (``labels.masked_fill(loss_mask == 0, IGNORE_INDEX)``): the last token
  of every sample, slot padding, prompts. No target crosses a sample boundary.
- mRoPE rows are ``PackedBatch.position_ids[1:]``, each sample's own rope index. Bridge's
  Qwen-VL models recompute the same rows per sample from ``input_ids`` and the grids
  (``packed_seq_utils.unpack_mcore_thd_tensor_for_position_ids``); other models read ours.
- Context parallelism: Bridge's VLM models cut the full row per CP rank themselves (after the
  vision merge), so the batch is the whole row; the packs need ``--pad-to-multiple-of 2*cp``
  (`train.context_parallel`, checked by ``open_packed_dataset(..., cp_size=cp)``).
- ``micro_batch_size`` is packs per micro-batch: Energon's ``batch_size`` packs are joined
  into one row (`train.batch.concat_batches`), as Bridge's in-batch packing joins rows.

``visual_inputs`` is Megatron-Bridge's own ``GenericVisualInputs`` when ``megatron.bridge`` is
importable, else `VisualInputs`, a copy of its fields and ``normalized_for_model``. Keywords it
has no field for (Idefics3 ``pixel_attention_mask``, LLaVA-OneVision ``batch_num_images``) go
into `PackedVisualInputs`, a subclass; ``vlm_step`` drops keywords the model's forward does not
take.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from megatron.energon import stateless

from packvlm.energon import PackedSample, PackedTaskEncoder
from train.batch import IGNORE_INDEX, PackedBatch
from train.encoder import PackedBatchTaskEncoder
from train.identity import ModelConfigSource

BRIDGE_VISUAL_INPUTS = "megatron.bridge.training.utils.visual_inputs"


def sample_index(batch: PackedBatch) -> torch.Tensor:
    """``[T]`` int64: the sample each row position belongs to, -1 on slot padding."""
    real = batch.cu_seqlens.long()
    lengths = real[1:] - real[:-1]
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=real.device), lengths)
    offsets = torch.arange(owner.numel(), device=real.device) - torch.repeat_interleave(real[:-1], lengths)
    index = torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=real.device)
    index[batch.cu_seqlens_padded[:-1].long()[owner] + offsets] = owner
    return index.to(batch.labels.device)


def shift_labels(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """HF (unshifted) labels -> Megatron's pre-shifted ``labels`` and float ``loss_mask``.

    Returns:
        ``labels`` int64 ``[1, T]`` and ``loss_mask`` float32 ``[1, T]``; ``labels[t]`` is
        ``batch.labels[t + 1]`` where ``loss_mask[t]`` is 1, else 0.
    """
    owner = sample_index(batch)
    hf = batch.labels.reshape(-1)
    target = hf[1:]
    same_sample = (owner[:-1] == owner[1:]) & (owner[:-1] >= 0)
    valid = same_sample & (target != IGNORE_INDEX)
    labels = torch.zeros_like(hf)
    labels[:-1] = torch.where(valid, target, torch.zeros_like(target))
    loss_mask = torch.zeros(hf.shape, dtype=torch.float32, device=hf.device)
    loss_mask[:-1] = valid.to(torch.float32)
    return labels.view(1, -1), loss_mask.view(1, -1)


@dataclass
class VisualInputs:
    """Megatron-Bridge's ``GenericVisualInputs`` (training/utils/visual_inputs.py) for machines without it.

    Same fields, order and methods. Not frozen and not slotted on purpose: ``vlm_step`` moves the
    tensors to the GPU through ``__dict__`` and blanks payloads on later pipeline stages with
    ``setattr`` on a ``copy``.
    """

    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None

    def as_model_kwargs(self) -> dict[str, torch.Tensor]:
        """The non-None fields, as model keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        """`as_model_kwargs` with Qwen-style batched tensors flattened, as Bridge does.

        ``pixel_values`` / ``pixel_values_videos`` ``[B, N, C, H, W] -> [B*N, C, H, W]`` and
        ``image_grid_thw`` / ``video_grid_thw`` ``[B, N, 3] -> [B*N, 3]``; everything else as is.
        """
        kwargs = self.as_model_kwargs()
        for name in ("pixel_values", "pixel_values_videos"):
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == 5:
                b, n, c, h, w = value.shape
                kwargs[name] = value.view(b * n, c, h, w)
        for name in ("image_grid_thw", "video_grid_thw"):
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == 3:
                kwargs[name] = value.view(-1, value.size(-1))
        return kwargs


def bridge_visual_inputs_class() -> type:
    """Bridge's ``GenericVisualInputs`` where importable (older: ``Qwen2_5_VLVisualInputs``), else `VisualInputs`."""
    try:
        module = importlib.import_module(BRIDGE_VISUAL_INPUTS)
    except ImportError:
        return VisualInputs
    for name in ("GenericVisualInputs", "Qwen2_5_VLVisualInputs"):
        if hasattr(module, name):
            found: type = getattr(module, name)
            return found
    return VisualInputs


if TYPE_CHECKING:
    _Base = VisualInputs
else:
    _Base = bridge_visual_inputs_class()


@dataclass
class PackedVisualInputs(_Base):
    """Bridge's container (`bridge_visual_inputs_class`) plus the keywords of families it has no field for.

    Every ``GenericVisualInputs`` field is declared again so an older base (Bridge's
    ``Qwen2_5_VLVisualInputs``: pixels and grids only) holds them too; defined at module level so
    loader workers can pickle it.
    """

    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    pixel_attention_mask: torch.Tensor | None = None  # Idefics3 / SmolVLM
    batch_num_images: torch.Tensor | None = None  # LLaVA-OneVision


def visual_inputs(vision: dict[str, torch.Tensor]) -> Any:
    """``PackedBatch.vision`` as Bridge's visual-inputs object (an empty one for a text-only row).

    Raises:
        ValueError: a keyword neither container has a field for (names it).
    """
    for cls in (_Base, PackedVisualInputs):
        if set(vision) <= {f.name for f in fields(cls)}:
            return cls(**vision)
    known = sorted(f.name for f in fields(PackedVisualInputs))
    raise ValueError(f"vision keywords {sorted(set(vision) - set(known))} have no field in {known}")


def bridge_batch(batch: PackedBatch) -> dict[str, Any]:
    """One micro-batch in Megatron-Bridge's ``vlm_step`` layout (see the module docstring); pure."""
    labels, loss_mask = shift_labels(batch)
    labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    multimodal = batch.position_ids.dim() == 3  # [4, 1, T]: text row, then t/h/w
    position_ids = batch.position_ids[1:].clone() if multimodal else batch.position_ids
    cu_seqlens = batch.cu_seqlens.to(torch.int32)
    cu_seqlens_padded = batch.cu_seqlens_padded.to(torch.int32)
    padded = None if torch.equal(cu_seqlens, cu_seqlens_padded) else cu_seqlens_padded
    return {
        "input_ids": batch.input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "visual_inputs": visual_inputs(batch.vision_inputs()),  # Bridge's step takes floats: made here
        "attention_mask": None,
        "padding_mask": (sample_index(batch) < 0)[None],
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_kv": cu_seqlens,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "max_seqlen_q": torch.tensor(batch.max_seqlen, dtype=torch.int32),
        "max_seqlen_kv": torch.tensor(batch.max_seqlen, dtype=torch.int32),
        "total_tokens": batch.num_tokens,
    }


class BridgeTaskEncoder(PackedTaskEncoder[PackedBatch, PackedBatch, dict[str, Any]]):
    """Energon TaskEncoder yielding Megatron-Bridge ``vlm_step`` batches from `prep pack` datasets.

    Packs become `PackedBatch` rows exactly as `train.encoder.PackedBatchTaskEncoder` makes them
    (same hooks, same per-process lazy `PackEncoder`); ``encode_batch`` turns each micro-batch
    into `bridge_batch`. Hand it to Bridge's data module, ``micro_batch_size`` packs per row::

        EnergonMultiModalDataModule(path, tokenizer, seq_length=PACK_SIZE, micro_batch_size=k,
                                    task_encoder=BridgeTaskEncoder(processor_dir, model_dir), ...)
    """

    #: a failing pack is a broken plan, not noise: stop at the first (Energon's default skips 99)
    __default_failure_tolerance__ = 1

    def __init__(self, processor: str, model_config: ModelConfigSource) -> None:
        super().__init__()
        self.packs = PackedBatchTaskEncoder(processor, model_config, pixels="float32")  # Bridge's step takes floats

    @stateless
    def encode_sample(self, sample: PackedSample) -> PackedBatch:
        return self.packs.encode_sample(sample)

    @stateless
    def batch(self, samples: list[PackedBatch]) -> PackedBatch:
        return self.packs.batch(samples)

    @stateless
    def encode_batch(self, batch: PackedBatch) -> dict[str, Any]:
        return bridge_batch(batch)
