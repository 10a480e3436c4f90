"""InternVL 3 / 3.5 example processor: an offline ``InternVLProcessor`` directory.

The example byte-level BPE plus the InternVL added tokens (``<img>``, ``</img>``,
``<IMG_CONTEXT>``, ``<quad>`` ... ``</box>``, ``<video>``, as transformers'
``convert_internvl_weights_to_hf.write_tokenizer`` adds them to the Qwen2.5 tokenizer, with the
same ``extra_special_tokens`` names), the chat template of that script (the one the ``-hf``
checkpoints ship), and the image / processor settings of ``OpenGVLab/InternVL3-1B-hf``
(``preprocessor_config.json``: GotOcr2, 448x448 tiles, ``crop_to_patches: false``, patches
1..12; ``processor_config.json``: ``image_seq_length`` 256). InternVL3.5-hf checkpoints share
the tokenizer format, template and GotOcr2 settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken

from families.example.base import ExampleFamily
from families.example.model import ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import build_tokenizer, tokenizer_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# transformers/models/internvl/convert_internvl_weights_to_hf.py `chat_template`, verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
# OpenGVLab/InternVL3-1B-hf preprocessor_config.json
PREPROCESSOR_CONFIG = {
    "crop_size": None,
    "crop_to_patches": False,
    "data_format": "channels_first",
    "default_to_square": True,
    "do_center_crop": None,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_processor_type": "GotOcr2ImageProcessorFast",
    "image_std": [0.229, 0.224, 0.225],
    "max_patches": 12,
    "min_patches": 1,
    "processor_class": "InternVLProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 448, "width": 448},
}


def build_internvl_dir(out: Path) -> Path:
    """Write the InternVL3-1B-hf-like processor directory to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer("qwen2_vl")
    first_added = tokenizer.get_vocab_size(with_added_tokens=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in INTERNVL_TOKENS])
    tokenizer.add_special_tokens([AddedToken("<video>", special=True, normalized=False)])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    config = tokenizer_config("qwen2_vl", first_added)
    for key in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
        config.pop(key)
    config["extra_special_tokens"] = NAMED_TOKENS
    config["model_max_length"] = 8192
    (out / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, "utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG), "utf-8")
    processor_config = {"image_seq_length": 256, "processor_class": "InternVLProcessor"}
    (out / "processor_config.json").write_text(json.dumps(processor_config), "utf-8")
    model = {"architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl"}
    (out / "config.json").write_text(json.dumps(model), "utf-8")
    return out


PATCH_SIZE = 14  # InternViT (InternVL3-1B-hf vision_config.patch_size)
DOWNSAMPLE_RATIO = 0.5  # pixel shuffle: 2 x 2 patches per image token


def internvl_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``InternVLConfig``: InternViT at the processor's 448 px tile, patch 14, pixel shuffle 0.5, Qwen2 decoder.

    Each tile gives (448 / 14 * 0.5)^2 = 256 features, the processor's ``image_seq_length``;
    ``<IMG_CONTEXT>`` is the image token.
    """
    from transformers import InternVLConfig

    side = int(facts.image["size"]["height"])
    seq_len = int(facts.processor["image_seq_length"])
    if int(side // PATCH_SIZE * DOWNSAMPLE_RATIO) ** 2 != seq_len:
        raise ValueError(f"{facts.path}: image_seq_length {seq_len} is not ({side} / {PATCH_SIZE} * 0.5)^2")
    vision = vision_config(
        model_type="internvl_vision",
        image_size=[side, side],
        patch_size=[PATCH_SIZE, PATCH_SIZE],
        hidden_dropout_prob=0.0,
        projection_dropout=0.0,
    )
    return InternVLConfig(
        text_config=text_config(facts, model_type="qwen2", rope_theta=1_000_000.0),
        vision_config=vision,
        image_token_id=facts.token_id(NAMED_TOKENS["context_image_token"]),
        image_seq_length=seq_len,
        downsample_ratio=DOWNSAMPLE_RATIO,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="internvl",
        build_processor=build_internvl_dir,
        description="InternVL added tokens, conversion-script chat template and image settings of "
        "OpenGVLab/InternVL3-1B-hf",
        build_model=TinyModel(internvl_model_config),
    ),
)
