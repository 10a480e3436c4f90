"""The model, the processor and the shards must belong together: checked before the first step.

Three mismatches used to surface only as a crash (or worse, silence) deep inside a step:

1. **Processor settings.** `prep tokenize` recorded its processor's identity in the manifest:
   the class *and* a sha256 over everything that shapes token ids (tokenizer, chat template,
   image / video settings; `families.processor.ProcessorBundle.identity`). A processor of
   the same class with other pixel limits counts other tokens, so the identity, not the class
   name, is compared.
2. **Model family.** The model's config must be one that takes this processor's inputs:
   transformers' own ``PROCESSOR_MAPPING_NAMES`` (model type -> processor class), plus the
   checkpoints it does not map (below). A Qwen3-VL model on Qwen2-VL shards used to fail at
   step 1 with ``shape '[-1, 3, 2, 16, 16]' is invalid``.
3. **Token ids.** The ids the shards use for image / video placeholders (the family layout's
   ``mm_token_ids``) must be the model config's ``image_token_id`` / ``image_token_index`` /
   ``video_token_id`` / ``video_token_index``, and every token id must be inside the model's
   vocabulary.

The processor is loaded once per process (`families.processor.load_processor_once`): the dataset
check and the loader's encoder share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from families.layout import IMAGE, VIDEO
from families.processor import ProcessorBundle
from packvlm.errors import UsageError
from schemas.manifest import ProcessorIdentity

#: config attribute -> which placeholder it names (transformers uses both spellings)
TOKEN_ID_FIELDS = {
    "image_token_id": IMAGE,
    "image_token_index": IMAGE,
    "video_token_id": VIDEO,
    "video_token_index": VIDEO,
}
#: checkpoints whose model type transformers does not map to the processor they ship with
EXTRA_MODEL_TYPES: Mapping[str, tuple[str, ...]] = {
    "PixtralProcessor": ("llava",),  # mistral-community/pixtral-12b: a llava config with a Pixtral tower
    "Qwen2_5OmniProcessor": ("qwen2_5_omni_thinker",),  # the thinker is what trains on text + images
    "Qwen3OmniMoeProcessor": ("qwen3_omni_moe_thinker",),
}


ModelConfigSource = str | PretrainedConfig  # a model directory (config.json) or a config object


def load_model_config(model_config: ModelConfigSource) -> PretrainedConfig:
    """A config object from a directory / hub id, or the object itself."""
    if isinstance(model_config, PretrainedConfig):
        return model_config
    return AutoConfig.from_pretrained(str(model_config))


class IdentityMismatch(UsageError, ValueError):
    """Model, processor and shards do not belong together; the message names both sides."""


def check_processor_identity(bundle: ProcessorBundle, recorded: Iterable[ProcessorIdentity], data: str) -> None:
    """The training processor must be the one (class and settings) the shards were tokenized with."""
    ours = bundle.identity()
    for identity in recorded:
        if identity.class_name != ours["class"]:
            raise IdentityMismatch(
                f"--processor {bundle.source} is a {ours['class']} but {data} was tokenized with a "
                f"{identity.class_name} ({identity.source}): train with the processor the data was tokenized with, "
                "or re-run `prep tokenize` and `prep pack` with yours"
            )
        if identity.sha256 != ours["sha256"]:
            raise IdentityMismatch(
                f"--processor {bundle.source} ({ours['class']}, settings sha256 {ours['sha256'][:12]}) differs from "
                f"the processor {data} was tokenized with ({identity.source}, sha256 {identity.sha256[:12]}): same "
                "class, other tokenizer, chat template or media settings, so other token counts; train with the "
                "processor the data was tokenized with, or re-run `prep tokenize` and `prep pack` with yours"
            )


def expected_processors(config: PretrainedConfig) -> set[str]:
    """Processor classes whose inputs a model of this config takes (empty: unknown model type)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = str(getattr(config, "model_type", ""))
    names = {PROCESSOR_MAPPING_NAMES.get(model_type)}
    names |= {cls for cls, types in EXTRA_MODEL_TYPES.items() if model_type in types}
    return {n for n in names if n}


def _vocab_size(config: PretrainedConfig) -> int | None:
    text = getattr(config, "text_config", None)
    size = getattr(text, "vocab_size", None) if text is not None else None
    return size if size is not None else getattr(config, "vocab_size", None)


def check_model_matches_data(
    config: PretrainedConfig, bundle: ProcessorBundle, mm_token_ids: Mapping[int, int], model: str
) -> None:
    """The model config takes this processor's inputs and token ids; `IdentityMismatch` otherwise.

    A text-only config (no ``vision_config``) may train on the text of any data: packs that
    carry media are refused at the forward, which names them.
    """
    name = f"--model {model} ({type(config).__name__}, model_type {getattr(config, 'model_type', '?')!r})"
    vocab = _vocab_size(config)
    if vocab is not None and len(bundle.tokenizer) > vocab:
        raise IdentityMismatch(
            f"{name} has a vocabulary of {vocab} but the processor's tokenizer has {len(bundle.tokenizer)} tokens: "
            "the shards hold ids the model cannot embed; use the model the processor belongs to"
        )
    if getattr(config, "vision_config", None) is None:
        return
    expected = expected_processors(config)
    if bundle.processor_class not in expected:
        takes = " or ".join(sorted(expected)) or "an unknown processor"
        raise IdentityMismatch(
            f"{name} takes the inputs of {takes}, but the shards were tokenized with a {bundle.processor_class}: "
            "train the model family the data was tokenized for, or re-run `prep tokenize` with this model's processor"
        )
    for field, kind in TOKEN_ID_FIELDS.items():
        model_id: Any = getattr(config, field, None)
        data_id = mm_token_ids.get(kind)
        if model_id is not None and data_id is not None and int(model_id) != int(data_id):
            what = "image" if kind == IMAGE else "video"
            raise IdentityMismatch(
                f"{name} has {field} {model_id} but the shards use token id {data_id} for {what} placeholders: "
                "the model and the processor disagree; use the model config that belongs to the processor"
            )
