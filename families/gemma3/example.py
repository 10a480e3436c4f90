"""Example Gemma 3 processor directory (``Gemma3Processor``), built offline.

Settings of google/gemma-3-4b-it (the 12B and 27B instruct checkpoints ship the same image
settings): ``preprocessor_config.json`` 896 x 896, bilinear, mean/std 0.5, every pan-and-scan
key ``null`` (``Gemma3Processor.images_kwargs`` fills them at call time);
``processor_config.json`` ``image_seq_length`` 256; the chat template of its
``tokenizer_config.json``, verbatim (``<bos>``, ``<start_of_turn>user\\n`` ... ``<end_of_turn>\\n``,
``<start_of_turn>model\\n``; one ``<start_of_image>`` per image; text parts ``| trim``).

Tokenizer: a small BPE trained here, loaded by transformers' own ``GemmaTokenizer`` (spaces
become ``▁``, no pre-tokenizer split, byte fallback), so BPE merges freely across newlines, as
in the real Gemma vocabulary where ``"\\n\\n"`` joins neighbouring text. Special tokens at
Gemma's ids where the small vocabulary allows (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
``<unk>`` 3, ``<mask>`` 4, ``<start_of_turn>`` 105, ``<end_of_turn>`` 106; ``<unusedN>``
between), the byte-fallback tokens next, and ``<start_of_image>``, ``<end_of_image>``,
``<image_soft_token>`` last, in Gemma's order (255999, 256000, 262144 upstream).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import gemma_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "google/gemma-3-4b-it"
BOI, EOI, IMAGE_SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
LEADING_SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    *(f"<unused{i}>" for i in range(100)),  # ids 5..104
    "<start_of_turn>",  # 105
    "<end_of_turn>",  # 106
)
BPE_VOCAB_SIZE = 900
_CORPUS = (
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom.",
    "Here is the original image and here are some crops to help you see better",
    "The second photo shows a dog. Where is the tree? Next to the house.",
    "user\n\n\nmodel\nabc\n\ndef\n\nghi.\n\n?\n\n:\n\n1\n\n x\n\n y\n\n\n\n",
    "abc def ghi 0123456789 It is a picture. Same. Three images. The tree.",
    "Look:\n\nThat\n\n. And here?\n\nWhat is it?\n\n",
    # text touching an image block: "\n\n" merges with its neighbours, as in Gemma's vocabulary
    *(f"{w}\n\n" for w in ("abc", "def", "ghi", "1", "x", "y", "is", "it", "here?", ".")),
    *(f"\n\n{w}" for w in ("abc", "def", "ghi", "1", "x", "y", "What", "Describe", "\n")),
)
# google/gemma-3-4b-it tokenizer_config.json "chat_template", verbatim.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# google/gemma-3-4b-it preprocessor_config.json
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}


def build_gemma3_processor_dir(out: Path) -> Path:
    """Write a ``Gemma3Processor`` directory (tokenizer, image settings, template) to ``out``."""
    tokenizer = gemma_tokenizer(
        leading=LEADING_SPECIALS,
        media=(BOI, EOI, IMAGE_SOFT),
        corpus=_CORPUS,
        named={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_SOFT},
        vocab_size=BPE_VOCAB_SIZE,
    )
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", {"image_seq_length": 256, "processor_class": "Gemma3Processor"})
    (out / "chat_template.jinja").write_text(GEMMA3_CHAT_TEMPLATE, "utf-8")
    return out


# One local (sliding-window) and one global layer, as the checkpoints interleave them 5:1; a window
# of 16 tokens so that it matters inside short test samples (the checkpoints: 1024).
SLIDING_WINDOW = 16
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}


def gemma3_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``Gemma3Config``: SigLIP at the processor's 896 px, patch 14, pooled to ``image_seq_length`` tokens.

    The projector average-pools the 64x64 patch grid to sqrt(mm_tokens_per_image) per side, so
    ``mm_tokens_per_image`` is the processor's ``image_seq_length`` (256: 4x4 pooling).
    """
    from transformers import Gemma3Config

    size = facts.image["size"]
    if size["height"] != size["width"]:
        raise ValueError(f"{facts.path}: Gemma 3 images are square, got size {size}")
    text = text_config(
        facts,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=SLIDING_WINDOW,
        rope_parameters=GEMMA3_ROPE,
    )
    vision = vision_config(
        model_type="siglip_vision_model", image_size=int(size["height"]), patch_size=14, vision_use_head=False
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=int(facts.processor["image_seq_length"]),
        boi_token_index=facts.token_id(BOI),
        eoi_token_index=facts.token_id(EOI),
        image_token_index=facts.token_id(IMAGE_SOFT),
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="gemma3",
        build_processor=build_gemma3_processor_dir,
        description=f"Gemma tokenizer format (small BPE, real special tokens), chat template and image settings of "
        f"{CHECKPOINT}",
        build_model=TinyModel(gemma3_model_config),
    ),
)
