"""Load the model `train hf` trains: a Hugging Face directory with weights, or a config alone.

    DIR/config.json + model*.safetensors | pytorch_model*.bin   -> from_pretrained (the weights)
    DIR/config.json only                                         -> from_config, random init

A config-only directory is how tests and the quickstart train without downloading anything
(``prep example OUT`` writes one to ``OUT/model``). Its initialisation depends only on the
config and ``seed``: the global RNG is seeded inside a forked RNG state, so the same
directory and seed give bit-identical weights whatever the caller drew before, and the
caller's RNG stream is left as it was.

The class is ``AutoModelForImageTextToText`` when the config is a vision-language one,
``AutoModelForCausalLM`` otherwise (text-only). The returned model is ready for packed rows
(`train.attention.prepare_model_for_packing`) and uses ``attn_implementation``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from packvlm.errors import UsageError
from train.attention import FLASH_ATTENTION, PACKED_ATTENTION, prepare_model_for_packing, register_packed_attention

log = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelLoadError(UsageError):
    """The model directory cannot give a model; the message says what to fix."""


def has_weights(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds weights that ``from_pretrained`` would load."""
    return any((Path(model_dir) / name).is_file() for name in WEIGHT_FILES)


def _auto_class(config: object) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def auto_class(config: object) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The transformers Auto class `load_model` builds ``config``'s model with."""
    return _auto_class(config)


#: model types whose image tokens attend both ways, which flash attention drops: transformers 5.8 - 5.12
#: still mark Gemma 3 ``_supports_flash_attn = True`` (5.2x refuse it themselves)
BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3"})


def _packable_attention(config: object, auto_class: type, attn_implementation: str) -> str:
    """``packvlm_varlen`` for a model class that refuses flash attention (Gemma 3: its image blocks)."""
    model_class = auto_class._model_mapping.get(type(config), None)  # type: ignore[attr-defined]
    refuses = not getattr(model_class, "_supports_flash_attn", True)
    if getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODEL_TYPES:
        refuses = True
    if attn_implementation == FLASH_ATTENTION and refuses:
        log.info("%s does not support %s: using %s", model_class.__name__, FLASH_ATTENTION, PACKED_ATTENTION)
        return PACKED_ATTENTION
    return attn_implementation


def _model_config(model_dir: Path, attn_implementation: str) -> tuple[object, Any, str]:
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; pass a Hugging Face model directory to --model")
    register_packed_attention()
    config = AutoConfig.from_pretrained(str(model_dir))
    auto_class = _auto_class(config)
    return config, auto_class, _packable_attention(config, auto_class, attn_implementation)


def build_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str
) -> PreTrainedModel:
    """The model class of ``model_dir`` built from its config on the current default device, weights
    not read (under ``torch.device("meta")``: no memory at all, for sharded loading)."""
    config, auto_class, attn_implementation = _model_config(Path(model_dir), attn_implementation)
    model = auto_class.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return prepare_model_for_packing(model)


def load_model(
    model_dir: str | Path,
    *,
    seed: int,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str,
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """A model from ``model_dir`` on ``device``, weights loaded or initialised from ``seed``.

    Args:
        model_dir: Local Hugging Face model directory (``config.json`` required).
        seed: Seed of the random initialisation (config-only directories).
        dtype: Parameter dtype (fp32 master weights; the loop autocasts on GPU); ``"auto"``
            keeps the checkpoint's own dtype (`train.sharding` loads so, then casts per shard).
        attn_implementation: e.g. ``train.attention.select_attention(device)``.
        device: Where the parameters go.
    """
    model_dir = Path(model_dir)
    config, auto_class, attn_implementation = _model_config(model_dir, attn_implementation)
    if has_weights(model_dir):
        log.info("loading %s weights from %s", type(config).__name__, model_dir)
        model = auto_class.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn_implementation)
    else:
        log.info("no weights in %s: random init of %s with seed %d", model_dir, type(config).__name__, seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto_class.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    nn.Module.to(model, device)  # in place; transformers' wrapped `to` has no usable signature for type checkers
    return prepare_model_for_packing(model)


def auto_model_class(config: object) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The Auto class `load_model` builds for ``config`` (what `train export` rebuilds a checkpoint as)."""
    return _auto_class(config)
