"""Kimi K2.5 example processor: an offline ``Kimi_K25Processor`` directory and a tiny model.

Settings of moonshotai/Kimi-K2.5 (its ``preprocessor_config.json`` ``media_proc_cfg``:
``patch_size`` 14, ``merge_kernel_size`` 2, ``in_patch_limit`` 16384,
``patch_limit_on_one_side`` 512, mean / std 0.5; video ``in_patch_limit_each_frame`` 4096,
``temporal_merge_kernel_size`` 4, ``sample_fps`` 2), written in the transformers 5.24 keys
(``patch_size``, ``merge_size``, ``max_patches``, ``size.max_height`` / ``max_width``), whose
``Kimi_K25ImageProcessor`` / ``Kimi_K25VideoProcessor`` class defaults carry the same values.
Both are torchvision classes: loading this directory with its image processor needs torchvision.
The video keys are what `families.kimi_k25.settings.KimiK25VideoSettings` reads (frames resized
with the 4096-patch budget, chunks of 4); ``fps`` / ``do_sample_frames`` are overridden by the
dataset's sampling at every call. The tiny model's ``pos_emb_time`` (4) covers a chunk's frames.

Tokenizer: a small byte-level BPE (the checkpoint's tiktoken split without its Han-class
intersections) carrying Kimi's special tokens at ids 0.. in the checkpoint's order
(``[BOS]`` ``[EOS]`` ``<|im_end|>`` ``<|im_user|>`` ``<|im_assistant|>`` ``<|im_system|>``, the five
tool-call markers, ``<|im_middle|>`` ... ``<|media_pad|>`` ``<think>`` ``</think>``; 163584.. upstream,
the tool-call markers 163595..163599 as several public copies of the K2 token table list them).
Chat template: K2.5's, written out here (equal in what it renders, not in text):
``<|im_system|>system<|im_middle|>`` ... ``<|im_end|>`` for a system turn (no default one),
``<|im_user|>user<|im_middle|>``, ``<|im_assistant|>assistant<|im_middle|>`` (a message's ``name``
replaces the role there); each image
``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` and each video
``<|kimi_k25_video_placeholder|>``, both followed by a newline; every message up to the last reply
without tool calls is history, whose replies carry an empty ``<think></think>``; replies after it
keep ``<think>reasoning</think>`` unless ``thinking`` is false; the generation prompt opens
``<think>`` (``<think></think>`` when ``thinking`` is false); tool declarations (``tools_ts_str`` or
compact JSON), tool calls and ``## Return of <id>`` tool turns as K2.5 writes them.

Provenance (no verbatim copy of the K2.5 hub files was found; each value's source):

- chat template: two public copies of K2.5's ``chat_template.jinja``, each edited by its user and
  otherwise the same text: radixark/miles ``miles/utils/chat_template_utils/templates/kimi_k25_fixed.jinja``
  @ 31f1ca96 (last changed in cbe19400; a ``preserve_thinking`` switch added) and baidu-baige/LoongForge
  ``loongforge/data/chat_templates/kimi_k2_5_training.jinja`` @ c6275661 (``{% generation %}`` blocks
  added). With those edits undone this template renders the same text on 234 conversations (system,
  multi-turn, reasoning, images, videos, names, tools, tool calls and results, ``thinking`` unset / true
  / false, with and without the generation prompt). It is Kimi-K2-Thinking's (ggml-org/llama.cpp
  ``models/templates/moonshotai-Kimi-K2-Thinking.jinja`` @ 0c3c896e) with ``<|media_begin|>``, videos,
  TypeScript tool declarations and the ``thinking`` switch, and without K2-Thinking's default system
  turn. Unsloth's K2.5 guide shows a default system turn in its render of a user-only conversation;
  both copies, ms-swift's ``kimi_k25`` template (``default_system=None``) and modular's K2.5 test
  prompt have none. Before this was checked the example had that default system turn, no newline after
  a video and kept the reasoning of replies after the last one without tool calls when ``thinking`` was
  false.
- ``<|media_begin|>`` (K2-Thinking writes ``<|media_start|>``): both copies and vLLM's ``kimi_k25.py``
  placeholder;
- image settings: the transformers 5.24 ``Kimi_K25ImageProcessor`` class defaults, not verified
  against the checkpoint's ``preprocessor_config.json`` itself; two third-party copies of its
  ``media_proc_cfg`` in the code index (files 57858465447 and 54589287414, repositories unnamed)
  agree on every value above; special-token ids: not the checkpoint's (``<|media_pad|>`` is 163605);
- the video placeholder: the two template copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from families.example.base import ExampleFamily, write_json
from families.example.model import TEXT_HIDDEN, ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import train_byte_level_bpe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "moonshotai/Kimi-K2.5"
SPECIALS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<think>",
    "</think>",
    "<|kimi_k25_video_placeholder|>",
    "[UNK]",
    "[PAD]",
)
KIMI_SPLIT = (
    r"[\p{Han}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom.",
    "system user assistant image video 0123456789 (parens) [brackets]",
    "The second photo shows a dog. Where is the tree? Next to the house.",
    "Let me think about it. First the cat, then the dog.",
]
KIMI_K25_TEMPLATE = """{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
        {{- c -}}
    {%- elif c is not none -%}
        {%- for part in c -%}
            {%- if part['type'] in ['image', 'image_url'] -%}
                {{- '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n' -}}
            {%- elif part['type'] in ['video', 'video_url'] -%}
                {{- '<|kimi_k25_video_placeholder|>\\n' -}}
            {%- else -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_header(message) -%}
    {%- set name = message.get('name') or message['role'] -%}
    {%- if message['role'] == 'user' -%}
        {{- '<|im_user|>' + name + '<|im_middle|>' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_assistant|>' + name + '<|im_middle|>' -}}
    {%- else -%}
        {{- '<|im_system|>' + name + '<|im_middle|>' -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message) -%}
    {{- '<|tool_calls_section_begin|>' -}}
    {%- for call in message['tool_calls'] -%}
        {%- set args = call['function']['arguments'] -%}
        {{- '<|tool_call_begin|>' + call['id'] + '<|tool_call_argument_begin|>' -}}
        {{- args if args is string else args | tojson -}}
        {{- '<|tool_call_end|>' -}}
    {%- endfor -%}
    {{- '<|tool_calls_section_end|>' -}}
{%- endmacro -%}
{%- set ns = namespace(last_reply=-1) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}{%- set ns.last_reply = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_system|>tool_declare<|im_middle|>' -}}
    {{- tools_ts_str if tools_ts_str else tools | tojson(separators=(',', ':')) -}}
    {{- '<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {{- render_header(message) -}}
    {%- if message['role'] == 'assistant' -%}
        {%- if loop.index0 <= ns.last_reply or (thinking is defined and thinking is false) -%}
            {{- '<think></think>' -}}
        {%- else -%}
            {{- '<think>' + message.get('reasoning_content', '') + '</think>' -}}
        {%- endif -%}
        {{- render_content(message) -}}
        {%- if message.get('tool_calls') -%}{{- render_tool_calls(message) -}}{%- endif -%}
    {%- elif message['role'] == 'tool' -%}
        {{- '## Return of ' + message.get('tool_call_id', '') + '\\n' + render_content(message) -}}
    {%- else -%}
        {{- render_content(message) -}}
    {%- endif -%}
    {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_assistant|>assistant<|im_middle|>' -}}
    {%- if thinking is defined and thinking is false -%}{{- '<think></think>' -}}{%- else -%}{{- '<think>' -}}{%- endif -%}
{%- endif -%}"""  # noqa: E501
# moonshotai/Kimi-K2.5 media_proc_cfg, in transformers 5.24's keys (module docstring)
IMAGE_SETTINGS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "max_patches": 16384,
    "size": {"max_height": 512, "max_width": 512},
}
VIDEO_SETTINGS: dict[str, Any] = {**IMAGE_SETTINGS, "max_patches": 4096, "temporal_patch_size": 4, "fps": 2}
_PIXELS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
}


def build_processor_dir(out: Path) -> Path:
    """Write the Kimi K2.5 processor directory to ``out``."""
    tok = train_byte_level_bpe(KIMI_SPLIT, CORPUS * 10, vocab_size=700, special_tokens=SPECIALS, unk_token="[UNK]")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "TokenizersBackend",
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "unk_token": "[UNK]",
            "pad_token": "[PAD]",
            "add_bos_token": False,
        },
    )
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Kimi_K25ImageProcessor",
            "processor_class": "Kimi_K25Processor",
            **_PIXELS,
            **IMAGE_SETTINGS,
        },
    )
    write_json(
        out / "video_preprocessor_config.json",
        {
            "video_processor_type": "Kimi_K25VideoProcessor",
            "processor_class": "Kimi_K25Processor",
            "do_sample_frames": True,
            **_PIXELS,
            **VIDEO_SETTINGS,
        },
    )
    write_json(out / "processor_config.json", {"processor_class": "Kimi_K25Processor"})
    (out / "chat_template.jinja").write_text(KIMI_K25_TEMPLATE, "utf-8")
    return out


def kimi_k25_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny Kimi K2.5: a 2-layer MoonViT (2x2 merge) and a 2-layer DeepSeek-V3 decoder (MLA, 4 experts).

    Layer 0 is dense, layer 1 a MoE (4 routed experts, top 2, one shared): routing is per token,
    and transformers' DeepSeek-V3 adds no auxiliary or sequence-level balance loss (its
    ``e_score_correction_bias`` is a buffer no forward updates), so a packed row trains as its
    samples alone. The image token is the tokenizer's ``<|media_pad|>``.
    """
    from transformers import Kimi_K25Config

    patch = int(facts.image["patch_size"])
    merge = int(facts.image["merge_size"])
    vision = vision_config(
        patch_size=patch,
        merge_kernel_size=[merge, merge],
        pos_emb_height=64,
        pos_emb_width=64,
        pos_emb_time=4,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    vision.pop("attention_dropout")
    text = text_config(
        facts,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        moe_intermediate_size=TEXT_HIDDEN,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=True,
    )
    return Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=vision["hidden_size"],
        image_token_id=facts.token_id("<|media_pad|>"),
        video_token_id=facts.token_id("<|kimi_k25_video_placeholder|>"),
        vision_start_token_id=facts.token_id("<|media_begin|>"),
        vision_end_token_id=facts.token_id("<|media_end|>"),
        tie_word_embeddings=True,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="kimi_k25",
        build_processor=build_processor_dir,
        description=f"Kimi special tokens, chat template format and image settings of {CHECKPOINT} (needs torchvision)",
        build_model=TinyModel(kimi_k25_model_config),
    ),
)
