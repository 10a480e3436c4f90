"""Which parameters train: a model's parameters split into groups, and ``--freeze GROUP``.

Every parameter of a vision-language model belongs to exactly one group, read off the module
path (a `peft` wrapper's ``base_model.model.`` prefix and its ``lora_A``/``lora_B`` leaves are
looked through, so a LoRA model groups the same way)::

    group      modules (first match along the dotted path)                     families
    vision     visual, vision_tower, vision_model                              all
    audio      audio_tower, embed_audio                                        Qwen2.5-Omni, Qwen3-Omni, Gemma 4
    projector  multi_modal_projector, connector, image_newline, projector,     LLaVA*, InternVL, Gemma 3, Mistral 3,
               embed_vision, mm_projector, merger (top level)                  PaddleOCR-VL, Gemma 4, Kimi K2.5,
                                                                               MiniCPM-V 4.6
               and inside the vision root: merger, merger_list,                Qwen*-VL/Omni, GLM-4.xV
               deepstack_merger_list, downsample                               Idefics3, SmolVLM (connector)
    language   language_model, text_model, lm_head                             all

The projector is what maps the vision tower's output into the language model's embedding
space: Qwen's ``visual.merger`` (and Qwen3-VL's deepstack mergers) and GLM-4.xV's
``visual.downsample`` + ``visual.merger`` sit inside the vision module in transformers but
belong here. A text-only causal LM is all ``language``. A parameter of a vision-language
model that matches no rule raises `InternalError` naming it: a new family must be added to
the table, never silently trained or frozen.

Frozen parameters get ``requires_grad = False``: no gradient is computed or all-reduced
(`train.distributed.all_reduce_grads` takes ``requires_grad`` parameters) and the optimizer is
built over `trainable_parameters` only, so they hold no AdamW state either.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Literal, get_args

from torch import nn

from packvlm.errors import InternalError

log = logging.getLogger(__name__)

Group = Literal["vision", "audio", "projector", "language"]
GROUPS: tuple[Group, ...] = get_args(Group)

_ROOTS: dict[str, Group] = {
    "visual": "vision",
    "vision_tower": "vision",
    "vision_model": "vision",
    "audio_tower": "audio",
    "multi_modal_projector": "projector",
    "connector": "projector",
    "image_newline": "projector",
    "projector": "projector",  # PaddleOCR-VL (model.projector: 2x2 merge + MLP)
    "embed_vision": "projector",  # Gemma 4 (vision soft tokens into the text embedding space)
    "embed_audio": "audio",  # Gemma 4
    "mm_projector": "projector",  # Kimi K2.5
    "merger": "projector",  # MiniCPM-V 4.6 (model.merger, beside the vision tower; Qwen's sits inside it)
    "language_model": "language",
    "text_model": "language",
    "lm_head": "language",
}
#: children of a vision root that project into the language model (Qwen-VL/Omni, GLM-4.xV)
_VISION_PROJECTORS = frozenset({"merger", "merger_list", "deepstack_merger_list", "downsample"})


class UngroupedParameterError(InternalError):
    """A vision-language model has a parameter no group rule covers (a family missing from the table)."""


def is_multimodal(model: nn.Module) -> bool:
    """Whether ``model``'s config has a vision (or audio) part; a text-only causal LM is all language."""
    config = getattr(model, "config", None)
    return any(hasattr(config, name) for name in ("vision_config", "audio_config", "thinker_config"))


def parameter_group(name: str, *, multimodal: bool = True) -> Group:
    """The group of parameter ``name`` (as ``named_parameters`` gives it)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        group = _ROOTS.get(part)
        if group is None:
            continue
        if group == "vision" and index + 1 < len(parts) and parts[index + 1] in _VISION_PROJECTORS:
            return "projector"
        return group
    if not multimodal:
        return "language"
    raise UngroupedParameterError(
        f"parameter {name} belongs to no group (vision, audio, projector, language); "
        "add its module to the table in train/trainable.py"
    )


def parameter_groups(model: nn.Module) -> dict[str, Group]:
    """Parameter name -> group for every (deduplicated: tied weights once) parameter of ``model``."""
    multimodal = is_multimodal(model)
    return {name: parameter_group(name, multimodal=multimodal) for name, _ in model.named_parameters()}


def group_sizes(model: nn.Module) -> dict[Group, int]:
    """Elements per group (tied weights counted once)."""
    groups = parameter_groups(model)
    sizes: Counter[Group] = Counter()
    for name, param in model.named_parameters():
        sizes[groups[name]] += param.numel()
    return {group: sizes.get(group, 0) for group in GROUPS}


def freeze(model: nn.Module, groups: Iterable[Group]) -> int:
    """Set ``requires_grad = False`` on every parameter of ``groups``; returns the elements frozen."""
    frozen_groups = frozenset(groups)
    if not frozen_groups:
        return 0
    multimodal = is_multimodal(model)
    frozen = 0
    for name, param in model.named_parameters():
        if parameter_group(name, multimodal=multimodal) in frozen_groups:
            param.requires_grad_(False)
            frozen += param.numel()
    log.info("frozen %s: %s parameters", ", ".join(sorted(frozen_groups)), f"{frozen:,}")
    return frozen


def trainable_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters the optimizer steps (the others hold no optimizer state)."""
    return (p for p in model.parameters() if p.requires_grad)


def num_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in trainable_parameters(model))
