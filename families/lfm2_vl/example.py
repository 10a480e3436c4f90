"""LFM2-VL example processor: an offline ``Lfm2VlProcessor`` directory and a tiny model.

Settings of ``LiquidAI/LFM2-VL-450M`` as published with transformers 4.55 (remote code; read
from a stored copy of the repository): its ``processor_config.json`` (``do_image_splitting``
true, ``downsample_factor`` 2, ``encoder_patch_size`` 16, ``min_image_tokens`` 64,
``max_image_tokens`` 256, ``max_num_patches`` 1024, ``max_pixels_tolerance`` 2.0, ``min_tiles``
2, ``max_tiles`` 10, ``tile_size`` 512, ``use_image_special_tokens`` true, ``use_thumbnail``
false) and its ``preprocessor_config.json`` (mean / std 0.5, ``resample`` 2 = bilinear,
rescale 1/255), written here in transformers 5.x's layout: one ``preprocessor_config.json`` of
``Lfm2VlImageProcessor`` (torchvision only: ``image_processing_auto`` has no PIL twin). Its
``chat_template.jinja``, verbatim (``{{bos_token}}``, ``<|im_start|>role\n`` ...
``<|im_end|>\n``, one ``<image>`` per image, no default system prompt, no reasoning block).
Its ``config.json``: ``image_token_index`` 396, SigLIP2 patch 16, LFM2 text model with
``conv_L_cache`` 3 (10 conv and 6 attention layers).

Tokenizer: the example byte-level BPE (``PreTrainedTokenizerFast``) plus the LFM2 special
tokens, ids after the BPE vocabulary: ``<|pad|>``, ``<|startoftext|>`` (BOS), ``<|endoftext|>``,
the three FIM tokens, ``<|im_start|>``, ``<|im_end|>`` (EOS) in LFM2's order (0..7 upstream),
then ``<image>`` (396 upstream), the 100 tile position tokens ``<|img_row_R_col_C|>`` for R, C
in 1..10 (the most a grid of ``max_tiles`` 10 needs), ``<|img_thumbnail|>``,
``<|image_start|>``, ``<|image_end|>`` (their upstream ids are not checked here).

Provenance: every value above was compared with a copy of the checkpoint's files,
varun00391/local-finetuned-model ``LiquidAI:LFM2-VL-450M/lfm2-450m/`` @ a913c339 (the
transformers 4.55 revision): ``chat_template.jinja`` equal character for character;
``processor_config.json`` equal in every image setting (its ``use_image_special_tokens`` true is
also ``Lfm2VlProcessor``'s default, so it is not written here); ``preprocessor_config.json``'s
mean / std / ``resample`` / ``rescale_factor`` / ``max_num_patches`` / ``patch_size`` equal (it names
the remote-code ``Siglip2ImageProcessor``); ``special_tokens_map.json``'s BOS / EOS / PAD and image
tokens equal; ``config.json``'s ``image_token_index`` 396, ``conv_L_cache`` 3 and its 16 layer types
as described. Token ids other than the specials' order: not the checkpoint's (by design).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import _trained_bpe_json

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "LiquidAI/LFM2-VL-450M"
TEXT_SPECIALS = (
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
)
IMAGE_TOKEN, THUMBNAIL, IMAGE_START, IMAGE_END = "<image>", "<|img_thumbnail|>", "<|image_start|>", "<|image_end|>"
MAX_GRID_SIDE = 10  # the tokenizer's tile position tokens: rows and columns 1..10
POSITION_TOKENS = tuple(
    f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_GRID_SIDE + 1) for c in range(1, MAX_GRID_SIDE + 1)
)
IMAGE_SPECIALS = (IMAGE_TOKEN, *POSITION_TOKENS, THUMBNAIL, IMAGE_START, IMAGE_END)
# LiquidAI/LFM2-VL-450M chat_template.jinja, verbatim.
CHAT_TEMPLATE = (
    "{{bos_token}}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
# LiquidAI/LFM2-VL-450M processor_config.json (image settings) + preprocessor_config.json (pixels)
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "downsample_factor": 2,
    "encoder_patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Lfm2VlImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_tokens": 256,
    "max_num_patches": 1024,
    "max_pixels_tolerance": 2.0,
    "max_tiles": 10,
    "min_image_tokens": 64,
    "min_tiles": 2,
    "processor_class": "Lfm2VlProcessor",
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": 512, "width": 512},
    "tile_size": 512,
    "use_thumbnail": False,
}


def build_lfm2_vl_dir(out: Path) -> Path:
    """Write the LFM2-VL-450M-like processor directory to ``out`` (the same bytes on every build)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(_trained_bpe_json())  # the example BPE, no Qwen specials
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TEXT_SPECIALS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_SPECIALS])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    added = {
        str(first + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate((*TEXT_SPECIALS, *IMAGE_SPECIALS))
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "use_default_system_prompt": False,
    }
    write_json(out / "tokenizer_config.json", config)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, "utf-8")
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", {"processor_class": "Lfm2VlProcessor"})
    write_json(out / "config.json", {"architectures": ["Lfm2VlForConditionalGeneration"], "model_type": "lfm2_vl"})
    return out


# LFM2's text model: short causal convolutions (kernel conv_L_cache = 3) and attention layers
# (LFM2-VL-450M: 10 conv, 6 attention); here one of each, conv first as in the checkpoints.
LFM2_TEXT = {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5}


def lfm2_vl_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``Lfm2VlConfig``: SigLIP2 NaFlex tower at the processor's patch 16, pixel unshuffle 2, LFM2 decoder.

    The tower embeds up to ``max_num_patches`` patches per tile (its position grid is
    interpolated to each tile's shape); the projector unshuffles 2 x 2 patches into one token,
    as the processor counts them.
    """
    from transformers import Lfm2VlConfig

    image = facts.image
    patch = int(image["encoder_patch_size"])
    vision = vision_config(model_type="siglip2_vision_model", patch_size=patch, num_patches=256, vision_use_head=False)
    text = text_config(
        facts,
        model_type="lfm2",
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        **LFM2_TEXT,
    )
    return Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=facts.token_id(IMAGE_TOKEN),
        downsample_factor=int(image["downsample_factor"]),
        projector_hidden_size=64,
        projector_hidden_act="gelu",
        projector_bias=True,
        projector_use_layernorm=True,
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="lfm2_vl",
        build_processor=build_lfm2_vl_dir,
        description=f"LFM2 special tokens, chat template and image settings of {CHECKPOINT} (512 px tiles, "
        "SigLIP2 NaFlex patch 16, 2 x 2 unshuffle)",
        build_model=TinyModel(lfm2_vl_model_config),
    ),
)
