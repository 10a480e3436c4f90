"""Example Idefics3 / SmolVLM / SmolVLM2 processor directories, built offline.

A small byte-level BPE (the checkpoint's pre-tokenizer split) carries the family's added tokens
after its vocab: ``<fake_token_around_image>``, ``<image>``, ``<end_of_utterance>``,
``<global-img>`` and ``<row_1_col_1>`` .. ``<row_6_col_6>`` (the 36 tile tokens the checkpoints
ship; ``Idefics3Processor.__init__`` looks up exactly these). Settings per checkpoint
(``size.longest_edge`` / ``max_image_size.longest_edge`` / ``image_seq_len``; the last is
``int((tile // patch) ** 2 / scale_factor ** 2)`` of the vision tower, as the processor
docstring defines it):

- ``idefics3``: HuggingFaceM4/Idefics3-8B-Llama3, ``Idefics3Processor``: 1456 / 364 / 169
  (SigLIP-SO400M patch 14, scale factor 2; the ``Idefics3ImageProcessor()`` defaults that
  ``convert_idefics3_weights_to_hf.py`` saves). Llama 3 tokenizer: ``<|begin_of_text|>`` BOS.
- ``smolvlm``: HuggingFaceTB/SmolVLM-256M-Instruct, ``Idefics3Processor``: 2048 / 512 / 64
  (SigLIP-B/16-512, scale factor 4). SmolLM2 tokenizer: ``<|im_start|>`` BOS, no BOS added.
- ``smolvlm2``: HuggingFaceTB/SmolVLM2-2.2B-Instruct, ``SmolVLMProcessor``: 1536 / 384 / 81
  (SigLIP-SO400M-384 patch 14, scale factor 3), video sampling fps 1, up to 64 frames.

Chat template: the checkpoints' ``User:<image>text<end_of_utterance>\\nAssistant: reply`` format
(transformers ``models/smolvlm/processing_smolvlm.py`` ``DEFAULT_CHAT_TEMPLATE`` without its
video branch; Idefics3 opens with ``<|begin_of_text|>`` instead of ``<|im_start|>``). Message
content must be a list of parts: a plain-string content renders empty in this template.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, processors

from families.example.base import ExampleFamily, write_json
from families.example.model import ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import _corpus_lines, train_byte_level_bpe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *ROW_COL_TOKENS)
# Llama 3 (Idefics3-8B-Llama3) and SmolLM2 (GPT-2 style) tokenizer.json pre-tokenizer splits.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TEMPLATE_BODY = (
    "{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_CHAT_TEMPLATE = "<|im_start|>" + _TEMPLATE_BODY
IDEFICS3_CHAT_TEMPLATE = "<|begin_of_text|>" + _TEMPLATE_BODY


@lru_cache(maxsize=4)
def _bpe_json(split: str, leading: tuple[str, ...]) -> str:
    """Byte-level BPE of ``split`` trained on the example corpus; ``leading`` specials take ids 0.."""
    # paragraphs: the real vocabularies have "\n\n" as one token, which the tile rows produce
    corpus = [*_corpus_lines(400), *["Line one.\n\nLine two.\n"] * 50]
    return train_byte_level_bpe(split, corpus, vocab_size=1500, special_tokens=leading).to_str()


# checkpoint -> processor class, image settings (size, tile, image_seq_len), description
CHECKPOINTS: dict[str, tuple[str, int, int, int, str]] = {
    "idefics3": ("Idefics3Processor", 1456, 364, 169, "HuggingFaceM4/Idefics3-8B-Llama3"),
    "smolvlm": ("Idefics3Processor", 2048, 512, 64, "HuggingFaceTB/SmolVLM-256M-Instruct"),
    "smolvlm2": ("SmolVLMProcessor", 1536, 384, 81, "HuggingFaceTB/SmolVLM2-2.2B-Instruct"),
}


def _tokenizer(checkpoint: str) -> tuple[Tokenizer, dict[str, Any]]:
    """The BPE with the family's added tokens, and its tokenizer_config.json."""
    if checkpoint == "idefics3":
        tok = Tokenizer.from_str(_bpe_json(LLAMA3_SPLIT, ()))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|begin_of_text|>",)])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|end_of_text|>",)])
        tok.post_processor = processors.TemplateProcessing(  # Llama 3 prepends BOS
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
        )
        config: dict[str, Any] = {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<end_of_utterance>",
            "pad_token": "<|end_of_text|>",
        }
    else:
        tok = Tokenizer.from_str(_bpe_json(GPT2_SPLIT, ("<|endoftext|>", "<|im_start|>", "<|im_end|>")))
        config = {"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "pad_token": "<|im_end|>"}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
    config |= {
        "tokenizer_class": "TokenizersBackend",
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "end_of_utterance_token": "<end_of_utterance>",
            "global_image_token": "<global-img>",
        },
    }
    return tok, config


def build_idefics3_dir(out: Path, checkpoint: str = "idefics3") -> Path:
    """Write an Idefics3 / SmolVLM processor directory with ``checkpoint``'s settings to ``out``."""
    processor_class, longest_edge, tile, seq_len, _ = CHECKPOINTS[checkpoint]
    out.mkdir(parents=True, exist_ok=True)
    tok, config = _tokenizer(checkpoint)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", config)
    template = IDEFICS3_CHAT_TEMPLATE if checkpoint == "idefics3" else SMOLVLM_CHAT_TEMPLATE
    (out / "chat_template.jinja").write_text(template, "utf-8")
    image_type = "SmolVLMImageProcessor" if processor_class == "SmolVLMProcessor" else "Idefics3ImageProcessor"
    image = {
        "do_convert_rgb": True,
        "do_image_splitting": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": image_type,
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": tile},
        "processor_class": processor_class,
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": longest_edge},
    }
    write_json(out / "preprocessor_config.json", image)
    if processor_class == "SmolVLMProcessor":
        video = {
            **image,
            "video_processor_type": "SmolVLMVideoProcessor",
            "fps": 1,
            "num_frames": 64,
            "do_sample_frames": False,
            "size": {"longest_edge": tile},
            "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": tile}},
        }
        video.pop("image_processor_type")
        write_json(out / "video_preprocessor_config.json", video)
    write_json(out / "processor_config.json", {"image_seq_len": seq_len, "processor_class": processor_class})
    model_type = "smolvlm" if processor_class == "SmolVLMProcessor" else "idefics3"
    architecture = "SmolVLMForConditionalGeneration" if model_type == "smolvlm" else "Idefics3ForConditionalGeneration"
    write_json(out / "config.json", {"architectures": [architecture], "model_type": model_type})
    return out


# checkpoint -> the vision tower's patch size (SigLIP-SO400M 14, SigLIP-B/16 16)
VISION_PATCH = {"idefics3": 14, "smolvlm": 16, "smolvlm2": 14}


def idefics3_model_config(checkpoint: str, facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``Idefics3Config`` / ``SmolVLMConfig``: SigLIP at the processor's tile (``max_image_size``),
    the checkpoint's patch, and the pixel-shuffle ``scale_factor`` that gives ``image_seq_len`` per tile.

    ``image_seq_len == (tile // patch)^2 / scale_factor^2`` (169 = 26^2 / 2^2, 81 = 27^2 / 3^2).
    """
    from transformers import Idefics3Config, SmolVLMConfig

    tile = int(facts.image["max_image_size"]["longest_edge"])
    patch = VISION_PATCH[checkpoint]
    seq_len = int(facts.processor["image_seq_len"])
    scale = math.isqrt((tile // patch) ** 2 // seq_len)
    if (tile // patch) ** 2 != seq_len * scale**2:
        raise ValueError(f"{facts.path}: image_seq_len {seq_len} is no (tile {tile} // patch {patch})^2 / scale^2")
    model_type = "idefics3_vision" if facts.processor["processor_class"] == "Idefics3Processor" else "smolvlm_vision"
    config_class = Idefics3Config if model_type == "idefics3_vision" else SmolVLMConfig
    return config_class(
        text_config=text_config(facts, model_type="llama", rope_theta=100_000.0),
        vision_config=vision_config(model_type=model_type, image_size=tile, patch_size=patch),
        image_token_id=facts.token_id("<image>"),
        scale_factor=scale,
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = tuple(
    ExampleFamily(
        name=_name,
        build_processor=partial(build_idefics3_dir, checkpoint=_checkpoint),
        description=(
            f"{CHECKPOINTS[_checkpoint][0]}: tokenizer format, chat template and image settings of "
            f"{CHECKPOINTS[_checkpoint][4]}"
        ),
        build_model=TinyModel(partial(idefics3_model_config, _checkpoint)),
    )
    for _name, _checkpoint in (("idefics3", "idefics3"), ("smolvlm", "smolvlm2"))
)
