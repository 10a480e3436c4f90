"""Qwen2.5-Omni and Qwen3-Omni example processors (images; audio and video are not counted).

Each directory loads as the real ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` pieces
offline: a small byte-level BPE (:mod:`families.example.tokenizer`'s corpus) with the checkpoint's
special tokens in their upstream order, the named model tokens of its tokenizer_config.json
(``image_token``, ``audio_token``, ``vision_bos_token`` ...), its chat template and its
``preprocessor_config.json`` (image settings and the Whisper feature extractor's).

- ``qwen2_5_omni``: Qwen/Qwen2.5-Omni-7B. Specials 151643.. upstream: ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``, ``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>``,
  ``<|box_end|>``, ``<|quad_start|>``, ``<|quad_end|>``, ``<|vision_bos|>``, ``<|vision_eos|>``,
  ``<|vision_pad|>``, ``<|IMAGE|>``, ``<|VIDEO|>`` (here 3000..3013). Image: patch 14, merge 2,
  3136..12845056 px. Chat template: the checkpoint's (default system prompt "You are a helpful
  assistant.", ``<|vision_bos|><|IMAGE|><|vision_eos|>`` per image).
- ``qwen3_omni_moe``: Qwen/Qwen3-Omni-30B-A3B-Instruct. Qwen3 specials (``<|image_pad|>``,
  ``<|video_pad|>``, ``<|vision_start|>``/``<|vision_end|>``, ``<think>``) plus
  ``<|audio_start|>``, ``<|audio_end|>``, ``<|audio_pad|>``. Image: patch 16, merge 2,
  3136..12845056 px. Its chat template could not be read offline: the Qwen3-VL template
  (same ChatML, same image tags, no default system prompt) with an audio branch added.

Neither checkpoint ships a video_preprocessor_config.json, so none is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, TEXT_HIDDEN, ProcessorFacts, TinyModel, text_config
from families.example.templates import CHAT_TEMPLATES
from families.example.tokenizer import QWEN3_EXTRA_TOKENS, SPECIAL_TOKENS, _trained_bpe_json
from families.qwen2_vl.example import QWEN2_MROPE, QWEN3_MROPE, qwen2_5_vision, qwen3_vision

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QWEN2_5_OMNI_SPECIALS = tuple(
    f"<|{name}|>"
    for name in (
        "endoftext im_start im_end AUDIO audio_bos audio_eos box_end quad_start quad_end vision_bos "
        "vision_eos vision_pad IMAGE VIDEO"
    ).split()
)
QWEN3_OMNI_AUDIO = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
# Qwen/Qwen2.5-Omni-7B chat_template, verbatim.
QWEN2_5_OMNI_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio "
    "{{ audio_count.value }}: {% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN3_VIDEO_BRANCH = "                {%- elif content.type == 'video' or 'video' in content %}"
_QWEN3_AUDIO_BRANCH = (
    "                {%- elif content.type == 'audio' or 'audio' in content or 'audio_url' in content -%}\n"
    "                    <|audio_start|><|audio_pad|><|audio_end|>\n"
)


def qwen3_omni_template() -> str:
    """The Qwen3-VL template with an audio branch before each video branch (user and tool turns)."""
    template = CHAT_TEMPLATES["qwen3_vl"]
    if _QWEN3_VIDEO_BRANCH not in template:
        raise RuntimeError("the Qwen3-VL template changed: cannot add the Qwen3-Omni audio branch")
    return template.replace(_QWEN3_VIDEO_BRANCH, _QWEN3_AUDIO_BRANCH + _QWEN3_VIDEO_BRANCH)


WHISPER_FEATURES: dict[str, Any] = {  # the feature extractor part of both preprocessor_config.json files
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OmniCheckpoint:
    """What one example directory carries from its published checkpoint."""

    checkpoint: str
    processor_class: str
    specials: tuple[str, ...]  # special added tokens, in upstream id order
    plain: tuple[str, ...]  # added, not special (Qwen3's <think>)
    named: dict[str, str]  # tokenizer_config.json's named model tokens
    patch_size: int
    image_mean: list[float]
    image_std: list[float]
    template: str | None  # None: qwen3_omni_template()


OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
CHECKPOINTS = {
    "qwen2_5_omni": OmniCheckpoint(
        checkpoint="Qwen/Qwen2.5-Omni-7B",
        processor_class="Qwen2_5OmniProcessor",
        specials=QWEN2_5_OMNI_SPECIALS,
        plain=(),
        named={
            "image_token": "<|IMAGE|>",
            "video_token": "<|VIDEO|>",
            "audio_token": "<|AUDIO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
        patch_size=14,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
        template=QWEN2_5_OMNI_TEMPLATE,
    ),
    "qwen3_omni_moe": OmniCheckpoint(
        checkpoint="Qwen/Qwen3-Omni-30B-A3B-Instruct",
        processor_class="Qwen3OmniMoeProcessor",
        specials=SPECIAL_TOKENS + QWEN3_OMNI_AUDIO,
        plain=QWEN3_EXTRA_TOKENS,
        named={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "audio_token": "<|audio_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        template=None,
    ),
}


def _tokenizer(spec: OmniCheckpoint) -> Tokenizer:
    tokenizer = Tokenizer.from_str(_trained_bpe_json())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    return tokenizer


def build_processor_dir(out_dir: Path, family: str) -> Path:
    """Write the ``family`` (``qwen2_5_omni`` or ``qwen3_omni_moe``) processor directory; deterministic."""
    spec = CHECKPOINTS[family]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(spec)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", "utf-8")
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "extra_special_tokens": [t for t in spec.specials if t not in ("<|endoftext|>", "<|im_end|>")],
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
            **spec.named,
        },
    )
    (out_dir / "chat_template.jinja").write_text(spec.template or qwen3_omni_template(), "utf-8")
    write_json(
        out_dir / "preprocessor_config.json",
        {
            **WHISPER_FEATURES,
            "image_mean": spec.image_mean,
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": spec.image_std,
            "max_pixels": 12845056,
            "merge_size": 2,
            "min_pixels": 3136,
            "patch_size": spec.patch_size,
            "processor_class": spec.processor_class,
            "temporal_patch_size": 2,
        },
    )
    return out_dir


def _audio(facts: ProcessorFacts, **extra: Any) -> dict[str, Any]:
    """A 1-layer audio encoder of width 32 (never run: audio rows are unsupported_media), mel bins of the processor."""
    audio = {"num_mel_bins": int(facts.image["feature_size"]), "encoder_layers": 1, "encoder_attention_heads": 2}
    return audio | {"encoder_ffn_dim": 64, "d_model": 32, "output_dim": TEXT_HIDDEN, **extra}


def _named_ids(facts: ProcessorFacts) -> dict[str, Any]:
    """The thinker's token ids, from the tokenizer's named tokens (tokenizer_config.json)."""
    tok = facts.tokenizer
    names = ("image", "video", "audio", "vision_bos", "vision_eos", "audio_bos", "audio_eos")
    image, video, audio, vision_bos, vision_eos, audio_bos, audio_eos = (
        facts.token_id(str(getattr(tok, f"{name}_token"))) for name in names
    )
    return {
        "image_token_id": image,
        "video_token_id": video,
        "audio_token_id": audio,
        "vision_start_token_id": vision_bos,
        "vision_end_token_id": vision_eos,
        "audio_start_token_id": audio_bos,
        "audio_end_token_id": audio_eos,
        "user_token_id": facts.token_id("user"),  # `<|im_start|>user\n`: the talker finds user turns by it
    }


def omni_thinker_config(family: str, facts: ProcessorFacts) -> PretrainedConfig:
    """The tiny thinker (the trainable text model) of Qwen2.5-Omni / Qwen3-Omni for ``facts``' processor.

    ``train`` builds ``AutoModelForImageTextToText`` from it: ``Qwen2_5OmniThinkerForConditionalGeneration``
    / ``Qwen3OmniMoeThinkerForConditionalGeneration``. Vision: the Qwen2.5-VL windowed tower (2.5) or the
    Qwen3-VL tower with deepstack (3), the processor's patch geometry. Qwen3-Omni's decoder is a
    mixture of 4 experts, 2 per token.
    """
    from transformers import Qwen2_5OmniThinkerConfig, Qwen3OmniMoeThinkerConfig

    ids = _named_ids(facts)
    if family == "qwen2_5_omni":
        return Qwen2_5OmniThinkerConfig(
            text_config=text_config(facts, rope_parameters=QWEN2_MROPE),
            vision_config=qwen2_5_vision(facts),
            audio_config=_audio(facts, max_source_positions=1500, n_window=100),
            image_token_index=ids.pop("image_token_id"),
            video_token_index=ids.pop("video_token_id"),
            audio_token_index=ids.pop("audio_token_id"),
            **ids,
            dtype="float32",
        )
    rope = QWEN3_MROPE | {"rope_theta": 1_000_000.0}
    text = text_config(facts, rope_parameters=rope, head_dim=HEAD_DIM, sliding_window=None)
    text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": TEXT_HIDDEN // 2}
    return Qwen3OmniMoeThinkerConfig(
        text_config=text,
        vision_config=qwen3_vision(facts) | {"deepstack_visual_indexes": [0]},
        audio_config=_audio(facts, downsample_hidden_size=16),
        **ids,
        dtype="float32",
    )


EXAMPLES = tuple(
    ExampleFamily(
        name=_family,
        build_processor=partial(build_processor_dir, family=_family),
        description=f"special tokens, chat template and image settings of {_spec.checkpoint} (images only)",
        build_model=TinyModel(partial(omni_thinker_config, _family)),
    )
    for _family, _spec in CHECKPOINTS.items()
)
