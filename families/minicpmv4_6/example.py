"""MiniCPM-V 4.6 example processor: an offline ``MiniCPMV4_6Processor`` directory and a tiny model.

The checkpoint is ``openbmb/MiniCPM-V-4.6`` (the ``auto_docstring`` checkpoint of transformers
5.24 ``configuration_minicpmv4_6``; the model docs load ``openbmb/MiniCPM-V-4_6``): a SigLIP
tower with a 2x2 window-attention merger after layer ``insert_layer_id`` and a 2x2 MLP merger
(16 patches per token in ``"16x"`` mode), over a Qwen3.5 hybrid decoder (gated delta net +
gated full attention).

The directory is the Qwen3.5 example's tokenizer (`families.qwen3_vl.example`: the small BPE with
the Qwen special tokens) plus MiniCPM-V's markup tokens (``<image>``, ``</image>``, ``<slice>``,
``</slice>``, ``<image_id>``, ``</image_id>``, special, named in ``extra_special_tokens`` as the
processor reads them: ``tokenizer.image_start_token`` ...), and the checkpoint's own chat template
(:data:`MINICPMV4_6_CHAT_TEMPLATE`): Qwen3.5's with images as the bare ``<|image_pad|>`` (the
processor wraps it in ``<image>`` ... ``</image>`` itself), videos as ``<|video_pad|>``, the items
of one message joined by ``"\\n"``, and ``enable_thinking`` false unless passed: the generation
prompt then ends with an empty ``<think>\\n\\n</think>\\n\\n``; replies after the last user turn
render as ``<think>\\n{reasoning}\\n</think>\\n\\n{reply}`` (empty reasoning included), earlier
replies as the bare reply. Image settings: ``MiniCPMV4_6ImageProcessorPil``'s class values
(scale_resolution 448, patch_size 14, max_slice_nums 9, slice_mode true, downsample_mode "16x",
use_image_id true, mean/std 0.5), which equal the checkpoint's.

Provenance:

- chat template: character for character the checkpoint's, as two independent copies agree:
  sophgo/LLM-TPU ``models/MiniCPMV4_6/config/chat_template.jinja`` @ e2815801 (7301 characters,
  the same text as the ``chat_template`` of that folder's ``tokenizer_config.json`` @ bea5f3e4;
  the folder is openbmb/MiniCPM-V-4.6-AWQ's, per its README) and baidu-baige/LoongForge
  ``loongforge/data/chat_templates/minicpm_v_4_6_hf_training.jinja`` @ c6275661 ("Adapted from
  MiniCPM-V-4.6 tokenizer_config.json": the same text plus ``{% generation %}`` blocks, a video
  refusal and the equivalent ``enable_thinking is true`` test); both match the markers a third
  party detects this template by (``<|image_pad|>``, ``render_content(message.content)``, "No user
  query found in messages."). Before this was checked, the example had Qwen3-VL's template (no
  ``<think>`` blocks, items not joined by newlines).
- ``extra_special_tokens``: equal to that ``tokenizer_config.json``'s (which also names
  ``bos_token`` ``<|im_start|>`` and ``tokenizer_class`` ``Qwen2Tokenizer``; the tokenizer here is
  the offline BPE, not the checkpoint's vocabulary).
- image and video settings: equal to that folder's ``processor_config.json`` @ e2815801 (its video
  processor adds ``do_sample_frames`` true, ``stack_frames`` 1, ``max_num_frames`` 128); transformers'
  processor test (huggingface/transformers ``tests/models/minicpmv4_6/test_processing_minicpmv4_6.py``
  @ 05ac5107) names the same ``scale_resolution`` 448 and ``max_slice_nums`` 9.

``prep tokenize`` renders without template kwargs (``enable_thinking`` false; a finished conversation
renders the same either way, so counts equal the real processor's): a reply's mask starts after the
empty ``<think>`` block the generation prompt also writes, or, for a reply with inline reasoning, at
its reasoning (after ``<think>\\n``, where the thinking generation prompt ends).
The hub id the docs load is ``openbmb/MiniCPM-V-4_6``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.qwen3_vl.example import LINEAR_ATTENTION, QWEN3_5_ROPE
from families.qwen3_vl.example import build_processor_dir as build_qwen3_5_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "openbmb/MiniCPM-V-4.6"
MARKUP_TOKENS = {
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", **MARKUP_TOKENS}
# MiniCPMV4_6ImageProcessorPil / MiniCPMV4_6VideoProcessor class values (transformers 5.24)
IMAGE_SETTINGS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "downsample_mode": "16x",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_slice_nums": 9,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "scale_resolution": 448,
    "slice_mode": True,
    "use_image_id": True,
}
PROCESSOR_CLASS = "MiniCPMV4_6Processor"
# The checkpoint's chat template, character for character (module docstring: provenance).
MINICPMV4_6_CHAT_TEMPLATE = r"""{%- if enable_thinking is not defined -%}
    {%- set enable_thinking = false -%}
{%- endif -%}
{%- macro render_content(content, is_system_content=false) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- set ns = namespace(parts=[]) -%}
        {%- for item in content -%}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' -%}
                {%- if is_system_content -%}
                    {{- raise_exception('System message cannot contain images.') -}}
                {%- endif -%}
                {%- set ns.parts = ns.parts + ['<|image_pad|>'] -%}
            {%- elif 'video' in item or item.type == 'video' -%}
                {%- if is_system_content -%}
                    {{- raise_exception('System message cannot contain videos.') -}}
                {%- endif -%}
                {%- set ns.parts = ns.parts + ['<|video_pad|>'] -%}
            {%- elif 'text' in item -%}
                {%- set ns.parts = ns.parts + [item.text] -%}
            {%- else -%}
                {{- raise_exception('Unexpected item type in content.') -}}
            {%- endif -%}
        {%- endfor -%}
        {{- ns.parts | join('\n') -}}
    {%- elif content is none or content is undefined -%}
        {{- '' -}}
    {%- else -%}
        {{- raise_exception('Unexpected content type.') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def build_minicpmv4_6_dir(out_dir: Path) -> Path:
    """Write the MiniCPM-V 4.6-like processor directory (deterministic)."""
    out = build_qwen3_5_dir(Path(out_dir))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    markup = list(MARKUP_TOKENS.values())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in markup])
    (out / "tokenizer.json").write_text(tokenizer.to_str(), "utf-8")
    config = json.loads((out / "tokenizer_config.json").read_text("utf-8"))
    for i, token in enumerate(markup):
        config["added_tokens_decoder"][str(first + i)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    for key in ("image_token", "video_token", "vision_start_token", "vision_end_token"):
        config.pop(key, None)
    config["extra_special_tokens"] = NAMED_TOKENS
    config["tokenizer_class"] = "TokenizersBackend"
    _write_json(out / "tokenizer_config.json", config)
    (out / "chat_template.jinja").write_text(MINICPMV4_6_CHAT_TEMPLATE, "utf-8")
    image = {**IMAGE_SETTINGS, "image_processor_type": "MiniCPMV4_6ImageProcessor", "processor_class": PROCESSOR_CLASS}
    _write_json(out / "preprocessor_config.json", image)
    video = {
        **IMAGE_SETTINGS,
        "max_num_frames": 128,
        "video_processor_type": "MiniCPMV4_6VideoProcessor",
        "processor_class": PROCESSOR_CLASS,
    }
    _write_json(out / "video_preprocessor_config.json", video)
    _write_json(out / "processor_config.json", {"processor_class": PROCESSOR_CLASS})
    _write_json(
        out / "config.json", {"architectures": ["MiniCPMV4_6ForConditionalGeneration"], "model_type": "minicpmv4_6"}
    )
    return out


def minicpmv4_6_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``MiniCPMV4_6Config``: SigLIP-like tower at patch 14 (merger after layer 0), hybrid Qwen3.5 decoder."""
    from transformers import MiniCPMV4_6Config

    patch = int(facts.image["patch_size"])
    side = int(facts.image["scale_resolution"])
    vision = vision_config(
        model_type="minicpmv4_6_vision", image_size=side, patch_size=patch, hidden_act="gelu_pytorch_tanh"
    )
    text = text_config(facts, model_type="qwen3_5_text", head_dim=HEAD_DIM, rope_parameters=QWEN3_5_ROPE)
    text.update(LINEAR_ATTENTION)
    return MiniCPMV4_6Config(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        image_size=side,
        image_token_id=facts.token_id(NAMED_TOKENS["image_token"]),
        video_token_id=facts.token_id(NAMED_TOKENS["video_token"]),
        downsample_mode=str(facts.image["downsample_mode"]),
        tie_word_embeddings=False,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="minicpmv4_6",
        build_processor=build_minicpmv4_6_dir,
        description=f"{CHECKPOINT}: MiniCPMV4_6Processor, Qwen3.5 tokenizer + MiniCPM-V markup tokens, "
        "448 px slices (<= 9), 16x downsampling",
        build_model=TinyModel(minicpmv4_6_model_config),
    ),
)
