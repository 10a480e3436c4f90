"""LoRA adapters through peft (the optional extra ``packvlm[lora]``): only the adapters train.

``--lora-rank R`` wraps the loaded model with peft's LoRA on the **language model's** linear
layers: by default every ``nn.Linear`` inside its decoder layers (attention and MLP
projections: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` for most families,
``in_proj_*``/``out_proj`` of Qwen3.5's linear-attention layers). ``--lora-targets`` narrows
that to leaf names (``q_proj,v_proj``); names are matched inside the language model only, so a
vision block's ``mlp.gate_proj`` (Qwen2.5-VL) never gets an adapter by accident.

Every base parameter is frozen (peft's rule), so only ``lora_A``/``lora_B`` get gradients and
optimizer state; B starts at zero, so step 0 computes exactly the base model. Dropout is 0:
the packed forward stays equal to each sample alone and runs are reproducible.

Under FSDP2 (``--sharding full|hybrid``) peft wraps the model before ``fully_shard`` (on the
meta device when each rank reads its own shards): the frozen base weights are sharded like any
other, the adapters sit in their decoder layer's FSDP unit and only their gradients are
reduced. `init_adapters` draws ``lora_A`` from the seed independently of how the model was
built or sharded (each rank keeps its slice of one draw), so a sharded run starts from the same
adapters as one process.

The training loop keeps the transformers model (peft injects the LoRA layers into it in
place); the `peft.PeftModel` is kept beside it for saving. Checkpoints hold the model's DCP
shards (base and adapters; resume reloads them) and the adapter alone
(``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(base, DIR)``); `fold_adapters` merges a checkpoint's adapters into
its base weights for a plain transformers directory (`train.export`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from packvlm.errors import ResourceError, UsageError
from train.distributed import DistContext
from train.trainable import is_multimodal, parameter_group

log = logging.getLogger(__name__)

LoraExport = Literal["adapter", "merged"]
LORA_EXPORTS: tuple[LoraExport, ...] = ("adapter", "merged")
INSTALL_HINT = "pip install 'packvlm[lora]'  (or: pip install peft)"


class PeftMissingError(ResourceError):
    """--lora-rank needs peft, which is not installed."""


class LoraTargetError(UsageError):
    """--lora-targets names no linear layer of the language model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    """What `apply_lora` adds. ``alpha`` None: twice the rank (scale alpha / rank = 2)."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = ()  # leaf names inside the language model; empty: every decoder-layer linear

    @property
    def scale_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)


def require_peft() -> Any:
    """The peft module, or `PeftMissingError` (exit 3) with the install line."""
    try:
        import peft
    except ImportError as exc:
        raise PeftMissingError(f"--lora-rank needs peft, which is not installed: {INSTALL_HINT}") from exc
    return peft


def language_linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Full module name -> ``nn.Linear`` of every linear layer inside the language model's decoder layers."""
    multimodal = is_multimodal(model)
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or ".layers." not in f".{name}.":
            continue
        if parameter_group(f"{name}.weight", multimodal=multimodal) == "language":
            found[name] = module
    return found


def target_modules(model: nn.Module, targets: tuple[str, ...] = ()) -> list[str]:
    """The full module names LoRA adapts: ``targets`` (leaf names) inside the language model, or all of them."""
    layers = language_linear_layers(model)
    if not targets:
        chosen = list(layers)
    else:
        chosen = [name for name in layers if name.rsplit(".", 1)[-1] in targets]
        leaves = {name.rsplit(".", 1)[-1] for name in layers}
        unknown = sorted(set(targets) - leaves)
        if unknown:
            raise LoraTargetError(
                f"--lora-targets {','.join(unknown)}: no such linear layer in the language model; "
                f"it has {','.join(sorted(leaves))}"
            )
    if not chosen:
        raise LoraTargetError(f"{type(model).__name__} has no linear layer in its language model for LoRA")
    return chosen


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int = 0) -> Any:
    """Inject LoRA adapters into ``model`` in place and freeze every base parameter.

    The adapters come from `init_adapters` (``seed``; on the meta device they are drawn later,
    once materialised). Returns the `peft.PeftModel` (for saving); ``model`` itself, now holding
    the adapters, is what the loop trains (``peft_model.get_base_model() is model``).
    """
    peft = require_peft()
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.scale_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=target_modules(model, settings.targets),
    )
    with torch.random.fork_rng(devices=[]):  # peft's own draw is replaced below: leave the caller's RNG alone
        peft_model = peft.get_peft_model(model, config)
    init_adapters(model, seed)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d alpha %g: %s of %s parameters train", settings.rank, config.lora_alpha, trainable, total)
    return peft_model


def is_adapter_parameter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def init_adapters(model: nn.Module, seed: int) -> None:
    """``lora_A`` kaiming-uniform (peft's rule) from one generator seeded with ``seed``, adapters in name
    order; ``lora_B`` zero. A DTensor (FSDP2 shard) takes its slice of the same whole draw, so every
    placement, and one process, start from the same adapters. Parameters still on meta are skipped."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not is_adapter_parameter(name) or param.is_meta:
                continue
            whole = torch.zeros(param.shape, dtype=param.dtype)
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            if isinstance(param, DTensor):
                mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(whole)


def _whole(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded, possibly host-offloaded) parameter; a collective for a DTensor."""
    if not isinstance(param, DTensor):
        return param.detach().cpu()
    local = param.to_local().detach()
    on_mesh = param.device_mesh.device_type
    if local.device.type != on_mesh:  # --cpu-offload on CUDA: shards live on the host, NCCL gathers on the GPU
        local = local.to(on_mesh)
    sharded = DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return sharded.full_tensor().cpu()


def save_adapter(peft_model: Any, dest: Path, ctx: DistContext) -> None:
    """Write ``peft_model``'s adapter (``adapter_model.safetensors`` + ``adapter_config.json``) into ``dest``.

    Every rank calls it: only the adapters are gathered (collectives in name order, so FSDP2 shards
    work too; the base weights never leave their shards) and rank 0 writes; resume reads the DCP
    shards, this copy is for peft / vLLM users.
    """
    adapters = {name: _whole(p) for name, p in peft_model.named_parameters() if is_adapter_parameter(name)}
    if ctx.is_main:
        peft_model.save_pretrained(dest, state_dict=adapters)


_ADAPTER_A = re.compile(r"^(?P<layer>.+)\.lora_A\.(?P<adapter>[^.]+)\.weight$")


def fold_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict (peft names) as the plain model's: ``W = W0 + (B @ A) * scale`` per
    adapted layer (peft's ``merge``), ``.base_layer.`` dropped from every name, adapters removed."""
    folded = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_parameter(k)}
    for key, a in state.items():
        match = _ADAPTER_A.match(key)
        if match is None:
            continue
        layer, adapter = match["layer"], match["adapter"]
        b = state[f"{layer}.lora_B.{adapter}.weight"]
        base = folded[f"{layer}.weight"]
        folded[f"{layer}.weight"] = base + (b.to(base.dtype) @ a.to(base.dtype)) * scale
    return folded
