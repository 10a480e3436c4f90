"""Example LLaVA-OneVision and LLaVA-NeXT processor directories, built offline.

Each directory holds a small BPE carrying the checkpoint's special tokens (right after the BPE
vocab, where the real checkpoints add them after the base vocab), the chat template of
transformers' conversion script and the checkpoint's image / processor settings:

- ``llava_onevision``: llava-hf/llava-onevision-qwen2-0.5b-ov-hf. Tokenizer: the example
  byte-level BPE with the Qwen2 pre-tokenizer and specials, then ``<image>``, ``<video>`` (as
  ``convert_llava_onevision_weights_to_hf.py`` adds them to the Qwen2 tokenizer).
  ``preprocessor_config.json``: ``LlavaOnevisionImageProcessor``, 384x384 (SigLIP patch 14:
  27x27 = 729 features), 36 ``image_grid_pinpoints`` 384..2304 in steps of 384, mean/std 0.5.
  ``processor_config.json`` (the conversion script's ``LlavaOnevisionProcessor`` call):
  ``num_image_tokens`` 729, ``vision_feature_select_strategy`` "full", ``vision_aspect_ratio``
  "anyres_max_9" (the class default). Template: the conversion script's ``chat_template``
  (images first as ``<image>\\n``, assistant text in ``{% generation %}``).
- ``llava_next``: llava-hf/llava-v1.6-mistral-7b-hf. Tokenizer: a SentencePiece-style BPE
  (``LlamaTokenizer``: Metaspace ``▁``, byte fallback ``<0x00>``..``<0xFF>`` after ``<unk>``,
  ``<s>``, ``</s>``), then ``<image>`` and ``<pad>`` (32000 / 32001 upstream, as
  ``convert_llava_next_weights_to_hf.py`` adds them). ``preprocessor_config.json``:
  ``LlavaNextImageProcessor``, shortest edge 336, crop 336, pinpoints [[336, 672], [672, 336],
  [672, 672], [1008, 336], [336, 1008]], CLIP mean/std. ``processor_config.json``: patch_size
  14, ``vision_feature_select_strategy`` "default", ``num_additional_image_tokens`` 1. The
  conversion script defines no template; the checkpoint's ``chat_template.json`` is used
  (``[INST] <image>\\n... [/INST]``, replies `` reply</s> ``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import build_tokenizer, tokenizer_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers/models/llava_onevision/convert_llava_onevision_weights_to_hf.py `chat_template`, verbatim.
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# llava-hf/llava-v1.6-mistral-7b-hf chat_template.json, verbatim.
NEXT_MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'][0]['text'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '</s> '}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
ONEVISION_PINPOINTS = [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
SENTENCEPIECE_SPECIALS = ("<unk>", "<s>", "</s>")
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
_CORPUS = (
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom. 0 1 2 10 12 120 1234",
    "The second photo shows a dog. Where is the tree? Next to the house.\n\nabc def ghi",
    "[INST] image next to the text [/INST] answer: yes, no. First answer. Second answer.",
    "这是一只猫。图片里有什么？",
)


def build_onevision_dir(out: Path) -> Path:
    """llava-hf/llava-onevision-qwen2-0.5b-ov-hf settings (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer("qwen2_vl")
    first_added = tokenizer.get_vocab_size(with_added_tokens=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<image>", "<video>")])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    config = tokenizer_config("qwen2_vl", first_added)
    for key in ("vision_start_token", "vision_end_token"):
        config.pop(key)
    config.update(image_token="<image>", video_token="<video>", model_max_length=32768)
    write_json(out / "tokenizer_config.json", config)
    (out / "chat_template.jinja").write_text(ONEVISION_CHAT_TEMPLATE, "utf-8")
    write_json(
        out / "preprocessor_config.json",
        {
            "crop_size": None,
            "do_center_crop": None,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_grid_pinpoints": ONEVISION_PINPOINTS,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "LlavaOnevisionProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 384, "width": 384},
        },
    )
    write_json(
        out / "processor_config.json",
        {
            "image_token": "<image>",
            "num_image_tokens": 729,
            "processor_class": "LlavaOnevisionProcessor",
            "video_token": "<video>",
            "vision_aspect_ratio": "anyres_max_9",
            "vision_feature_select_strategy": "full",
        },
    )
    write_json(
        out / "config.json",
        {
            "architectures": ["LlavaOnevisionForConditionalGeneration"],
            "image_token_index": first_added + 14,
            "model_type": "llava_onevision",
            "video_token_index": first_added + 15,
            "vision_aspect_ratio": "anyres_max_9",
            "vision_feature_select_strategy": "full",
        },
    )
    return out


def _sentencepiece_bpe() -> Tokenizer:
    """A Llama/Mistral-style BPE: ▁ for spaces, byte fallback, ``<s>`` prepended."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = BpeTrainer(vocab_size=600, special_tokens=[*SENTENCEPIECE_SPECIALS, *_BYTE_TOKENS], show_progress=False)
    tokenizer.train_from_iterator(list(_CORPUS) * 10, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def build_next_dir(out: Path) -> Path:
    """llava-hf/llava-v1.6-mistral-7b-hf settings (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _sentencepiece_bpe()
    first_added = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<image>", "<pad>")])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "image_token": "<image>",
            "legacy": True,
            "model_max_length": 32768,
            "pad_token": "<pad>",
            "padding_side": "left",
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>",
        },
    )
    (out / "chat_template.jinja").write_text(NEXT_MISTRAL_CHAT_TEMPLATE, "utf-8")
    write_json(
        out / "preprocessor_config.json",
        {
            "aspect_ratio_setting": "anyres",
            "crop_size": {"height": 336, "width": 336},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_grid_pinpoints": NEXT_PINPOINTS,
            "image_mean": OPENAI_CLIP_MEAN,
            "image_processor_type": "LlavaNextImageProcessor",
            "image_std": OPENAI_CLIP_STD,
            "processor_class": "LlavaNextProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": 336},
        },
    )
    write_json(
        out / "processor_config.json",
        {
            "image_token": "<image>",
            "num_additional_image_tokens": 1,
            "patch_size": 14,
            "processor_class": "LlavaNextProcessor",
            "vision_feature_select_strategy": "default",
        },
    )
    write_json(
        out / "config.json",
        {
            "architectures": ["LlavaNextForConditionalGeneration"],
            "image_grid_pinpoints": NEXT_PINPOINTS,
            "image_token_index": first_added,
            "model_type": "llava_next",
            "vision_feature_select_strategy": "default",
        },
    )
    return out


def _tower(facts: ProcessorFacts, model_type: str, side: int, **extra: Any) -> dict[str, Any]:
    """A CLIP / SigLIP tower at the processor's tile side (patch 14, as both checkpoints)."""
    return vision_config(model_type=model_type, image_size=side, patch_size=14, **extra)


def onevision_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``LlavaOnevisionConfig``: SigLIP at the 384 px tile (27 x 27 = ``num_image_tokens`` features per
    tile, all kept: "full", last layer), the processor's pinpoints and ``vision_aspect_ratio``, a Qwen2 decoder."""
    from transformers import LlavaOnevisionConfig

    side = int(facts.image["size"]["height"])
    if (side // 14) ** 2 != int(facts.processor["num_image_tokens"]):
        raise ValueError(f"{facts.path}: num_image_tokens is not (tile / patch 14)^2")
    return LlavaOnevisionConfig(
        text_config=text_config(facts, model_type="qwen2", rope_theta=1_000_000.0),
        vision_config=_tower(facts, "siglip_vision_model", side, vision_use_head=False),
        image_token_index=facts.token_id(str(facts.processor["image_token"])),
        video_token_index=facts.token_id(str(facts.processor["video_token"])),
        vision_feature_select_strategy=facts.processor["vision_feature_select_strategy"],
        vision_feature_layer=-1,
        vision_aspect_ratio=str(facts.processor["vision_aspect_ratio"]),
        image_grid_pinpoints=facts.image["image_grid_pinpoints"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def next_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``LlavaNextConfig``: CLIP at the 336 px crop (24 x 24 patches + CLS, CLS dropped: "default", the
    second-to-last layer), the processor's pinpoints, a Mistral decoder."""
    from transformers import LlavaNextConfig

    side = int(facts.image["crop_size"]["height"])
    patch = int(facts.processor["patch_size"])
    if patch != 14 or int(facts.processor["num_additional_image_tokens"]) != 1:
        raise ValueError(f"{facts.path}: expected CLIP patch 14 with one CLS token")
    return LlavaNextConfig(
        text_config=text_config(facts, model_type="mistral", head_dim=HEAD_DIM, sliding_window=None),
        vision_config=_tower(
            facts, "clip_vision_model", side, hidden_act="quick_gelu", projection_dim=VISION_PROJECTION
        ),
        image_token_index=facts.token_id(str(facts.processor["image_token"])),
        vision_feature_select_strategy=facts.processor["vision_feature_select_strategy"],
        vision_feature_layer=-2,
        image_grid_pinpoints=facts.image["image_grid_pinpoints"],
        image_seq_length=(side // patch) ** 2,
        tie_word_embeddings=False,
        dtype="float32",
    )


VISION_PROJECTION = 32  # CLIPVisionConfig.projection_dim (unused by LLaVA, kept small)
EXAMPLES = (
    ExampleFamily(
        name="llava_onevision",
        build_processor=build_onevision_dir,
        description="tokenizer format, chat template and image settings of llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
        build_model=TinyModel(onevision_model_config),
    ),
    ExampleFamily(
        name="llava_next",
        build_processor=build_next_dir,
        description="tokenizer format, chat template and image settings of llava-hf/llava-v1.6-mistral-7b-hf",
        build_model=TinyModel(next_model_config),
    ),
)
