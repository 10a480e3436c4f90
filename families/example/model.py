"""Tiny, weightless model configs that match an example processor directory (every family).

``train hf --model DIR`` accepts a directory holding only ``config.json``: the model is then
initialised at random from the config with ``--seed`` (see :func:`train.models.load_model`).
Each family's example (``families/<name>/example.py``) carries a :class:`TinyModel`
as its ``build_model``: a function from the processor directory's facts to a config of the
family's real model class. What must match the processor is read from that directory
(:class:`ProcessorFacts`):

    vocab_size          len(tokenizer) (the small BPE + the family's added specials)
    image/video ids     the tokenizer's ids of the family's placeholders (<|image_pad|>, [IMG], ...)
    vision geometry     preprocessor_config.json / processor_config.json (patch size, tile size,
                        merge / pixel-shuffle factors, tokens per image or tile, pinpoints)

Everything else is small on purpose and shared here: 2 text layers, hidden 64, 4 heads, 2 kv
heads, head_dim 16 (:func:`text_config`), vision towers of width 32 and depth 2, fp32,
dropout 0, so a CPU forward and backward of a few-thousand-token pack takes well under a
second or two.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported on use: `prep --help` stays fast
    from transformers import PretrainedConfig

TEXT_HIDDEN = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
TEXT_LAYERS = 2
HEAD_DIM = TEXT_HIDDEN // TEXT_HEADS  # 16: rotary half-dimension 8
VISION_HIDDEN = 32
VISION_HEADS = 2
VISION_DEPTH = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessorFacts:
    """What a tiny model must agree with, read once from a processor directory."""

    path: Path
    tokenizer: Any  # the AutoTokenizer of the directory
    image: dict[str, Any]  # preprocessor_config.json
    processor: dict[str, Any]  # processor_config.json ({} when absent)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def token_id(self, token: str) -> int:
        """The tokenizer's id of ``token``; a ValueError when the tokenizer lacks it."""
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.path}: tokenizer has no {token!r}; is it this family's processor?")
        return int(token_id)

    def special_ids(self) -> dict[str, int | None]:
        """eos / pad / bos ids of the tokenizer (None where it has none)."""
        tok = self.tokenizer
        return {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text("utf-8")) if path.is_file() else {}


def read_processor_facts(processor_dir: str | Path) -> ProcessorFacts:
    """Tokenizer and image / processor settings of ``processor_dir``."""
    from transformers import AutoTokenizer

    path = Path(processor_dir)
    return ProcessorFacts(
        path=path,
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        image=_read_json(path / "preprocessor_config.json"),
        processor=_read_json(path / "processor_config.json"),
    )


def text_config(facts: ProcessorFacts, **overrides: Any) -> dict[str, Any]:
    """The tiny decoder every family shares; ``overrides`` add or replace family keys (rope, layer types)."""
    return {
        "vocab_size": facts.vocab_size,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 2 * TEXT_HIDDEN,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": TEXT_KV_HEADS,
        "max_position_embeddings": 32768,
        **facts.special_ids(),
        "dtype": "float32",
        **overrides,
    }


def vision_config(**overrides: Any) -> dict[str, Any]:
    """A tiny ViT in the ``num_hidden_layers`` / ``hidden_size`` naming (CLIP, SigLIP, Pixtral, InternViT, ...)."""
    return {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_hidden_layers": VISION_DEPTH,
        "num_attention_heads": VISION_HEADS,
        "attention_dropout": 0.0,
        "dtype": "float32",
        **overrides,
    }


def write_model_config(config: PretrainedConfig, out_dir: str | Path) -> Path:
    """``config.json`` and ``generation_config.json`` (no weights): the same config gives the same bytes."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    config = name_architecture(config)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return out_dir


def name_architecture(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with ``architectures`` naming the class ``AutoModelForImageTextToText`` builds from it.

    ``save_pretrained`` writes it only from a model; Megatron-Bridge's ``AutoBridge`` and other
    loaders pick the model by it.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not config.architectures:
        architecture = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
        if architecture is None:
            raise ValueError(f"model type {config.model_type!r} has no image-text-to-text class in this transformers")
        config.architectures = [architecture]
    return config


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A family's ``build_model``: ``(model_dir, processor_dir) -> model_dir`` from a config function.

    ``config(facts)`` builds the family's config; keeping it on the object lets tests and
    ``tiny_model_config`` read the config without writing it.
    """

    config: Callable[[ProcessorFacts], PretrainedConfig]

    def __call__(self, model_dir: Path, processor_dir: Path) -> Path:
        return write_model_config(self.config(read_processor_facts(processor_dir)), model_dir)
