"""Example Gemma 4 processor directory (``Gemma4Processor``), built offline.

Settings of google/gemma-4-31B-it (the E2B, E4B and 26B-A4B instruct checkpoints ship the same
image settings): the image section of its ``processor_config.json`` -- ``Gemma4ImageProcessor``,
``max_soft_tokens`` 280, ``patch_size`` 16, ``pooling_kernel_size`` 3, bicubic (``resample`` 3),
``do_rescale`` with 1/255, ``do_normalize`` false (mean 0, std 1), ``image_seq_length`` 280 --
written here as ``preprocessor_config.json`` for the PIL class ``Gemma4ImageProcessorPil``.
Video: ``video_preprocessor_config.json`` with ``Gemma4VideoProcessor``'s class defaults of
transformers 5.24 (``video_processing_gemma4.py``: ``max_soft_tokens`` 70 per frame, ``num_frames``
32 sampled uniformly, ``do_normalize`` true with mean 0 / std 1, bicubic), which the video
section of the checkpoints' ``processor_config.json`` repeats; without this file the video
processor would read ``preprocessor_config.json`` and take the image budget (280) per frame.

Chat template: the checkpoint's ``chat_template.jinja`` (the revision whose generation prompt
closes an empty thought channel, ``<|channel>thought\\n<channel|>``, unless ``enable_thinking``)
with its tool parts (the declaration / call / response macros and branches) left out: a system
turn ``<|turn>system\\n`` (``<|think|>`` first when thinking is on) ... ``<turn|>\\n``, turns
``<|turn>user\\n`` / ``<|turn>model\\n`` ... ``<turn|>\\n``, text parts ``| trim``, model text
with thought channels stripped (``strip_thinking``), ``"\\n\\n<|image|>\\n\\n"`` per image.

Tokenizer: a small BPE trained here, loaded by transformers' ``GemmaTokenizer`` (spaces become
``▁``, no pre-tokenizer split, byte fallback), with Gemma 4's special tokens: ``<pad>`` 0,
``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4, ``<|turn>`` 105, ``<turn|>`` 106 as upstream,
the thinking channel tokens next, then the byte-fallback tokens and the BPE, and the media tokens
last in Gemma 4's order (``<|image>`` 255999, ``<|audio>`` 256000, ``<|image|>`` 258880,
``<|audio|>``, ``<image|>`` 258882, ``<audio|>`` 258883, ``<|video|>`` 258884 upstream).

Provenance: the chat template equals, in every part a tool-free conversation reaches, the
Gemma 4 template llama.cpp stores (ggml-org/llama.cpp ``models/templates/gemma4.jinja`` @
75f1ba73: BOS, the system block with ``<|think|>``, ``| trim``, ``strip_thinking``,
``"\n\n<|image|>\n\n"``, ``"\n\n<|video|>\n\n"``, ``<turn|>\n``, the generation prompt's empty
thought channel). Image settings (``max_soft_tokens`` 280, patch 16, pooling 3, bicubic, rescale
only): ``Gemma4ImageProcessorPil`` class defaults, not verified against the checkpoint's
``processor_config.json`` (third-party configs in the code index agree: 280 soft tokens per image,
patch 16, pooling kernel 3, image / BOI / EOI ids 258880 / 255999 / 258882). Thinking-channel
token ids: not the checkpoint's (its ``<|think|>`` is 98, ``<|channel>`` 100, ``<channel|>`` 101).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config
from families.example.tokenizer import gemma_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "google/gemma-4-31B-it"
BOI, EOI, IMAGE_SOFT = "<|image>", "<image|>", "<|image|>"
BOA, EOA, AUDIO_SOFT, VIDEO_SOFT = "<|audio>", "<audio|>", "<|audio|>", "<|video|>"
LEADING_SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    *(f"<unused{i}>" for i in range(100)),  # ids 5..104
    "<|turn>",  # 105
    "<turn|>",  # 106
    "<|think|>",
    "<|channel>",
    "<channel|>",
)
MEDIA_SPECIALS = (BOI, BOA, IMAGE_SOFT, AUDIO_SOFT, EOI, EOA, VIDEO_SOFT)
BPE_VOCAB_SIZE = 900
_CORPUS = (
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom.",
    "The second photo shows a dog. Where is the tree? Next to the house.",
    "system\nuser\nmodel\nthought\nabc\n\ndef\n\nghi.\n\n?\n\n:\n\n1\n\n x\n\n y\n\n\n\n",
    "abc def ghi 0123456789 It is a picture. Same. Three images. The tree.",
    "Look:\n\nThat\n\n. And here?\n\nWhat is it?\n\nLet me think step by step.",
    *(f"{w}\n\n" for w in ("abc", "def", "ghi", "1", "x", "y", "is", "it", "here?", ".", "user\n")),
    *(f"\n\n{w}" for w in ("abc", "def", "ghi", "1", "x", "y", "What", "Describe", "\n")),
)
# google/gemma-4-31B-it chat_template.jinja without its tool parts (module docstring).
GEMMA4_CHAT_TEMPLATE = """{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}

{%- set ns = namespace(prev_message_type=None) -%}
{%- set loop_messages = messages -%}
{{ bos_token }}
{#- Handle System/Tool Definitions Block -#}
{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\\n' -}}

    {#- Inject Thinking token at the very top of the FIRST system turn -#}
    {%- if enable_thinking is defined and enable_thinking -%}
        {{- '<|think|>' -}}
        {%- set ns.prev_message_type = 'think' -%}
    {%- endif -%}

    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}

    {{- '<turn|>\\n' -}}
{%- endif %}

{#- Loop through messages -#}
{%- for message in loop_messages -%}
    {%- set ns.prev_message_type = None -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<|turn>' + role + '\\n' }}

            {%- if message['content'] is string -%}
                {%- if role == 'model' -%}
                    {{- strip_thinking(message['content']) -}}
                {%- else -%}
                    {{- message['content'] | trim -}}
                {%- endif -%}
            {%- elif message['content'] is sequence -%}
                {%- for item in message['content'] -%}
                    {%- if item['type'] == 'text' -%}
                        {%- if role == 'model' -%}
                            {{- strip_thinking(item['text']) -}}
                        {%- else -%}
                            {{- item['text'] | trim -}}
                        {%- endif -%}
                    {%- elif item['type'] == 'image' -%}
                        {{- '\\n\\n<|image|>\\n\\n' -}}
                        {%- set ns.prev_message_type = 'image' -%}
                    {%- elif item['type'] == 'audio' -%}
                        {{- '<|audio|>' -}}
                        {%- set ns.prev_message_type = 'audio' -%}
                    {%- elif item['type'] == 'video' -%}
                        {{- '\\n\\n<|video|>\\n\\n' -}}
                        {%- set ns.prev_message_type = 'video' -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}

        {{- '<turn|>\\n' -}}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|turn>model\\n' -}}
    {%- if not enable_thinking | default(false) -%}
        {{- '<|channel>thought\\n<channel|>' -}}
    {%- endif -%}
{%- endif -%}
"""
# google/gemma-4-31B-it processor_config.json, its "image_processor" section (PIL class here)
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": False,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_processor_type": "Gemma4ImageProcessorPil",
    "image_seq_length": 280,
    "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 280,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "processor_class": "Gemma4Processor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
}
# Gemma4VideoProcessor's class defaults (transformers 5.24) = the checkpoints' video section (module docstring)
VIDEO_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 70,
    "num_frames": 32,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "processor_class": "Gemma4Processor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "video_processor_type": "Gemma4VideoProcessor",
}
PROCESSOR_CONFIG: dict[str, Any] = {
    "audio_ms_per_token": 40,
    "audio_seq_length": 750,
    "image_seq_length": 280,
    "processor_class": "Gemma4Processor",
}


def build_gemma4_processor_dir(out: Path) -> Path:
    """Write a ``Gemma4Processor`` directory (tokenizer, image settings, template) to ``out``."""
    tokenizer = gemma_tokenizer(
        leading=LEADING_SPECIALS,
        media=MEDIA_SPECIALS,
        corpus=_CORPUS,
        named={
            "image_token": IMAGE_SOFT,
            "boi_token": BOI,
            "eoi_token": EOI,
            "audio_token": AUDIO_SOFT,
            "boa_token": BOA,
            "eoa_token": EOA,
        },
        vocab_size=BPE_VOCAB_SIZE,
    )
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(out / "video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", PROCESSOR_CONFIG)
    # with torchvision, AutoProcessor also builds the audio feature extractor and the video processor,
    # found by model type (a checkpoint directory's config.json, as GLM-4V's example writes too)
    write_json(out / "config.json", {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4"})
    (out / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE, "utf-8")
    return out


# One local (sliding-window) layer, then two global ones: the checkpoints interleave them 5:1 and end
# global; a global layer before the last one is where image tokens' (causal) outputs still reach the
# loss. A window of 16 tokens so that it matters inside short test samples (the checkpoints: 1024 / 512).
SLIDING_WINDOW = 16
VISION_HIDDEN = 32


def gemma4_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``Gemma4Config`` in the shape of gemma-4-31B-it: image blocks bidirectional on sliding layers.

    ``use_bidirectional_attention: "vision"`` as the 31B and 26B-A4B checkpoints set it (the
    E2B / E4B text configs leave it null: causal everywhere); the global layer has its own head
    size and K = V (``attention_k_eq_v``), proportional rope on a quarter of its dimensions; no
    per-layer embeddings, no KV sharing, no MoE (all per-token, nothing crosses tokens). The
    vision tower is Gemma 4's own at the processor's patch 16 / pooling 3; no audio tower.
    """
    from transformers import Gemma4Config

    text = text_config(
        facts,
        head_dim=HEAD_DIM,
        global_head_dim=2 * HEAD_DIM,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        sliding_window=SLIDING_WINDOW,
        use_bidirectional_attention="vision",
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=facts.vocab_size,
        final_logit_softcapping=30.0,
    )
    vision = {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": VISION_HIDDEN // 2,
        "patch_size": int(facts.image["patch_size"]),
        "pooling_kernel_size": int(facts.image["pooling_kernel_size"]),
        "dtype": "float32",
    }
    return Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=facts.token_id(BOI),
        eoi_token_id=facts.token_id(EOI),
        image_token_id=facts.token_id(IMAGE_SOFT),
        video_token_id=facts.token_id(VIDEO_SOFT),
        boa_token_id=facts.token_id(BOA),
        eoa_token_index=facts.token_id(EOA),
        audio_token_id=facts.token_id(AUDIO_SOFT),
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="gemma4",
        build_processor=build_gemma4_processor_dir,
        description=f"Gemma tokenizer format (small BPE, Gemma 4 special tokens), chat template and image settings "
        f"of {CHECKPOINT}",
        build_model=TinyModel(gemma4_model_config),
    ),
)
