"""Each rank reads only its own slices of a safetensors checkpoint into its FSDP2 shards.

Every rank, alone, with no whole copy of the model anywhere::

    build on meta -> buffers computed from the config -> fully_shard -> to_empty
        -> dcp.load({checkpoint key: this rank's DTensor shard}, HuggingFaceStorageReader(DIR))

``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader`` plans, for each DTensor, the rows
this rank holds and reads just those with safetensors' ``get_slice`` (the file is memory-mapped:
the other rows are never touched), copying them into the local shard and casting from the file's
dtype, as ``from_pretrained(dtype=...)`` casts. A 72B model on 8 ranks: each reads ~1/8 of the
144 GB, never the whole.

Keys: a checkpoint names its tensors as the model was saved (Qwen2-VL: ``model.layers.0...``,
``visual.blocks.0...``), transformers 5 names its modules otherwise
(``model.language_model.layers.0...``, ``model.visual.blocks.0...``); `checkpoint_key_map` applies
the class's own conversion mapping (``transformers.conversion_mapping``) the way
``from_pretrained`` does. A tied weight (a head tied to the embeddings) is read once, through
the parameter it shares. Buffers that are not weights (rotary frequencies, position ids, Gemma's
embedding scale) are computed from the config by the model's own ``_init_weights``, as
``from_pretrained`` computes them.

Not every checkpoint is a pure rename: a mapping that fuses or splits tensors (MoE experts,
fused qkv), a parameter the files lack, or a buffer ``_init_weights`` does not compute gives a
reason instead, and `train.sharding` falls back to rank 0 loading with ``from_pretrained`` and
broadcasting (as it does for ``pytorch_model*.bin`` checkpoints).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.futures import Future
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PEFT_BASE_LAYER = ".base_layer."  # peft's LoRA layer holds the wrapped module under this name


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardRead:
    """What one rank read: its bytes of the files, against the whole of every tensor it loaded."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one file, or those an index names); empty if it has none."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SAFETENSORS_FILE
    return [single] if single.is_file() else []


def checkpoint_keys(files: list[Path]) -> dict[str, torch.Size]:
    """Every tensor name in ``files`` with its shape (headers only)."""
    from safetensors import safe_open

    keys: dict[str, torch.Size] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                keys[key] = torch.Size(handle.get_slice(key).get_shape())
    return keys


def checkpoint_key_map(model: PreTrainedModel, keys: dict[str, torch.Size]) -> dict[str, str] | str:
    """Model state-dict name -> checkpoint key for every checkpoint tensor the model has; or why not.

    The names come from transformers' own renaming (``rename_source_key`` with the model's
    conversion mapping and base-model prefix, as ``from_pretrained`` calls it). A key that needs
    a conversion beyond a rename, or two keys landing on one name, is returned as a reason.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    prefix = model.base_model_prefix
    found: dict[str, str] = {}
    for key in sorted(keys):
        renamed, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as from_pretrained: the key as it is, perhaps with the prefix
            renamed, converted = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed not in meta:
            continue  # from_pretrained ignores it too (an unexpected key)
        if converted is not None:
            return f"checkpoint tensor {key} is converted ({converted}), not only renamed"
        if renamed in found:
            return f"checkpoint tensors {found[renamed]} and {key} both name {renamed}"
        if tuple(keys[key]) != tuple(meta[renamed].shape):
            return f"checkpoint tensor {key} has shape {tuple(keys[key])}, {renamed} {tuple(meta[renamed].shape)}"
        found[renamed] = key
    return found


def uncovered(model: PreTrainedModel, key_map: dict[str, str]) -> str | None:
    """Why the checkpoint cannot fill ``model`` alone (a parameter it lacks, its tie included); None if it can."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    covered = set(key_map)
    for target, source in tied.items():
        if target in covered or source in covered:
            covered |= {target, source}
    buffers = {name for name, _ in model.named_buffers()}
    for name in model.state_dict():
        if name not in covered and name not in buffers:
            return f"the checkpoint has no tensor for {name}"
    return None


def compute_buffers(model: PreTrainedModel) -> dict[str, torch.Tensor] | str:
    """Every buffer of a meta-built ``model``, computed on the host by its own ``_init_weights``; or why not.

    Each buffer is first filled with a sentinel (NaN, or the integer minimum); one left holding
    it was not computed, and is returned as a reason. The modules' parameters stay on meta (the
    initialisers touch them as no-ops), so nothing model-sized is allocated.
    """
    owners: list[tuple[str, PreTrainedModel]] = []  # (prefix, model), outermost first
    computed: dict[str, torch.Tensor] = {}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for name, module in model.named_modules():
            if isinstance(module, PreTrainedModel):
                owners.append((name, module))
            if not module._buffers:
                continue
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = _sentinel_like(buffer)
            owner = max((o for o in owners if not o[0] or name == o[0] or name.startswith(f"{o[0]}.")), key=_depth)
            owner[1]._init_weights(module)
            for key, buffer in module._buffers.items():
                full = f"{name}.{key}" if name else key
                if buffer is not None and bool(_is_sentinel(buffer).any()):
                    return f"buffer {full} is not computed by {type(owner[1]).__name__}._init_weights"
                if buffer is not None:
                    computed[full] = buffer.clone()
    return computed


def _depth(owner: tuple[str, PreTrainedModel]) -> int:
    return len(owner[0])


def _sentinel_like(buffer: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(buffer, device="cpu")
    if empty.is_floating_point():
        return empty.fill_(float("nan"))
    if empty.dtype == torch.bool:
        return empty.fill_(False)
    return empty.fill_(torch.iinfo(empty.dtype).min)


def _is_sentinel(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.is_floating_point():
        return torch.isnan(buffer)
    if buffer.dtype == torch.bool:
        return torch.zeros_like(buffer)
    return buffer == torch.iinfo(buffer.dtype).min


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy `compute_buffers`' values into the (emptied, device-placed) buffers of ``model``."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


class _CountingReader(HuggingFaceStorageReader):
    """The HF reader, counting the bytes this rank asks safetensors for (its slices only)."""

    bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            dtype = self.storage_data[item.storage_index].dtype
            self.bytes_read += math.prod(item.lengths) * dtype.itemsize
        return super().read_data(plan, planner)


def load_own_shards(model: nn.Module, model_dir: Path, key_map: dict[str, str]) -> ShardRead:
    """Fill ``model`` (sharded, materialised) from ``model_dir``: each rank reads only its own slices.

    Every rank calls it (DCP plans collectively). ``key_map`` is `checkpoint_key_map`'s, of the model
    before any LoRA wrapping (peft renames ``q_proj.weight`` to ``q_proj.base_layer.weight``). State-dict
    entries without a checkpoint key (tied weights, computed buffers, adapters) are left as they are.
    """
    state = get_model_state_dict(model)  # this rank's shards, sharing storage with the parameters
    to_read: dict[str, Any] = {}
    for name, tensor in state.items():
        key = key_map.get(name.replace(PEFT_BASE_LAYER, "."))  # a LoRA-wrapped layer's weight is the base's
        if key is not None:
            to_read[key] = tensor
    reader = _CountingReader(str(model_dir))
    dcp.load(to_read, storage_reader=reader)
    stored = reader.storage_data.items()
    whole = sum(math.prod(info.shape) * info.dtype.itemsize for index, info in stored if index.fqn in to_read)
    return ShardRead(tensors=len(to_read), bytes_read=reader.bytes_read, checkpoint_bytes=whole)
