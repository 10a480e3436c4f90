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

The training loop keeps the transformers model (peft injects the LoRA layers into it in
place); the `peft.PeftModel` is kept beside it for saving. Checkpoints hold the adapter
(``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(base, DIR)``) and resume re-applies it to the base model;
`export_merged` writes a plain transformers directory with the adapters folded in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

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

    ``lora_A`` is drawn from ``seed`` inside a forked RNG (as `train.models.load_model` draws a
    config-only model): the same options give the same adapters whatever the caller drew before.
    Returns the `peft.PeftModel` (for saving); ``model`` itself, now holding the adapters, is
    what the loop trains (``peft_model.get_base_model() is model``).
    """
    peft = require_peft()
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.scale_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=target_modules(model, settings.targets),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d alpha %g: %s of %s parameters train", settings.rank, config.lora_alpha, trainable, total)
    return peft_model


def is_adapter_parameter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def save_adapter(peft_model: Any, dest: Path, ctx: DistContext) -> None:
    """Write ``peft_model``'s adapter (``adapter_model.safetensors`` + ``adapter_config.json``) into ``dest``.

    Every rank calls it: the whole state is gathered first (a collective, so FSDP2 shards work too)
    and rank 0 writes; resume reads the DCP shards, this copy is for peft / vLLM users.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(peft_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        peft_model.save_pretrained(dest, state_dict=full)


def export_merged(peft_model: Any, dest: Path) -> Path:
    """Fold the adapters into the base weights (in place: call at the end) and ``save_pretrained`` to ``dest``."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(dest)
    return dest
