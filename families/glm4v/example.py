"""Example GLM-4.1V / 4.5V / 4.6V processor directories, built offline.

A small byte-level BPE with the GLM-4 pre-tokenizer split (cl100k-style, digits in runs of up
to 3) carries the GLM special tokens in their upstream order right after the BPE vocab:
``<|endoftext|>``, ``[MASK]``, ``[gMASK]``, ``[sMASK]``, ``<sop>``, ``<eop>``, ``<|system|>``,
``<|user|>``, ``<|assistant|>``, ``<|observation|>``, ``<|begin_of_image|>``,
``<|end_of_image|>``, ``<|begin_of_video|>``, ``<|end_of_video|>`` (151329..151342 upstream),
then ``<|image|>``, ``<|video|>`` (151343/151344) for GLM-4.1V, or the audio, code, think, tool,
``/nothink`` and box tokens first for GLM-4.5V/4.6V, whose ``<|image|>`` is 151363.

- ``glm4_1v``: zai-org/GLM-4.1V-9B-Thinking (GLM-4.5V ships the same image settings and
  processor class): ``Glm4vProcessor``; ``preprocessor_config.json`` patch 14, temporal 2,
  merge 2, ``size`` shortest_edge 12544 / longest_edge 9633792, CLIP mean/std;
  ``video_preprocessor_config.json`` ``size`` 12544 / 47040000 (the class default), fps 2.
  Chat template: GLM-4.1V-9B-Thinking's ``chat_template.jinja`` (revision 3c1471e5) verbatim:
  ``[gMASK]<sop><|user|>\\n...<|begin_of_image|><|image|><|end_of_image|>...<|assistant|>\\n``.
- ``glm4_6v``: ``Glm46VProcessor`` + ``Glm46VImageProcessor`` with the same numbers
  (zai-org/GLM-4.6V; zai-org/GLM-OCR's ``preprocessor_config.json`` is exactly these) and
  GLM-OCR's ``chat_template.jinja`` verbatim, the GLM-4.5V/4.6V format (tools, ``<think>``
  blocks, ``/nothink``) around the same image placeholder.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily, write_json
from families.example.model import (
    TEXT_HIDDEN,
    VISION_DEPTH,
    VISION_HEADS,
    VISION_HIDDEN,
    ProcessorFacts,
    TinyModel,
    text_config,
)
from families.example.tokenizer import train_byte_level_bpe
from families.qwen2_vl.example import patch_geometry, token_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GLM_BASE_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
GLM41V_SPECIAL_TOKENS = (*GLM_BASE_TOKENS, "<|image|>", "<|video|>")
GLM45V_SPECIAL_TOKENS = (
    *GLM_BASE_TOKENS,
    *"<|begin_of_audio|> <|end_of_audio|> <|begin_of_transcription|> <|end_of_transcription|>".split(),
    *"<|code_prefix|> <|code_middle|> <|code_suffix|> <think> </think> <tool_call> </tool_call>".split(),
    *"<tool_response> </tool_response> <arg_key> </arg_key> <arg_value> </arg_value> /nothink".split(),
    *"<|begin_of_box|> <|end_of_box|> <|image|> <|video|>".split(),
)
# GLM-4 tokenizer.json pre-tokenizer split (cl100k-style; digits in runs of 1-3).
GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = (
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom. 0 1 2 10 12 120 1234 0.5 seconds",
    "The second photo shows a dog. Where is the tree? Next to the house.\n\nabc def ghi",
    "这是一只猫。图片里有什么？ image begin end of video frame 3.0 seconds",
)
# zai-org/GLM-4.1V-9B-Thinking chat_template.jinja, verbatim.
GLM41V_CHAT_TEMPLATE = """[gMASK]<sop>
{%- for msg in messages %}
    {%- if msg.role == 'system' %}
<|system|>
{{ msg.content }}
    {%- elif msg.role == 'user' %}
<|user|>{{ '\\n' }}

        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}
                {%- if item.type == 'video' or 'video' in item %}
<|begin_of_video|><|video|><|end_of_video|>
                {%- elif item.type == 'image' or 'image' in item %}
<|begin_of_image|><|image|><|end_of_image|>
                {%- elif item.type == 'text' %}
{{ item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'assistant' %}
        {%- if msg.metadata %}
<|assistant|>{{ msg.metadata }}
{{ msg.content }}
        {%- else %}
<|assistant|>
{{ msg.content }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
# zai-org/GLM-OCR chat_template.jinja (Glm46VProcessor; the GLM-4.5V / 4.6V format: tools, think blocks), verbatim.
GLM_OCR_CHAT_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is mapping and (item.type == 'image' or 'image' in item) -%}
                <|begin_of_image|><|image|><|end_of_image|>
            {%- elif item is mapping and (item.type == 'video' or 'video' in item) -%}
                <|begin_of_video|><|video|><|end_of_video|>
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{% if m.content is string %}
{{ m.content }}
{%- else %}
{%- for item in m.content %}
{% if item.type == 'video' or 'video' in item %}
<|begin_of_video|><|video|><|end_of_video|>{% elif item.type == 'image' or 'image' in item %}
<|begin_of_image|><|image|><|end_of_image|>{% elif item.type == 'text' %}
{{ item.text }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{% elif m.content is iterable and m.content is not mapping %}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
{{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{%- for tr in m.content -%}
  {%- if tr is mapping and tr.type is defined -%}
    {%- set t = tr.type | lower -%}
    {%- if t == 'text' and tr.text is defined -%}
{{ tr.text }}
    {%- elif t in ['image', 'image_url'] -%}
<|begin_of_image|><|image|><|end_of_image|>
    {%- elif t in ['video', 'video_url'] -%}
<|begin_of_video|><|video|><|end_of_video|>
    {%- else -%}
{{ tr | tojson(ensure_ascii=False) }}
    {%- endif -%}
  {%- else -%}
{{ tr.output if tr.output is defined else tr }}
  {%- endif -%}
{%- endfor -%}
{{- '\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{{'<think></think>\n' if (enable_thinking is defined and not enable_thinking) else ''}}
{%- endif -%}"""  # noqa: E501
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# checkpoint -> (processor class, image processor type, video processor type)
GLM_CHECKPOINTS: dict[str, tuple[str, str, str]] = {
    "glm4_1v": ("Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
    "glm4_6v": ("Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor"),
}
# checkpoint -> (special tokens after the BPE vocab, chat template)
GLM_TOKENS_AND_TEMPLATE: dict[str, tuple[tuple[str, ...], str]] = {
    "glm4_1v": (GLM41V_SPECIAL_TOKENS, GLM41V_CHAT_TEMPLATE),
    "glm4_6v": (GLM45V_SPECIAL_TOKENS, GLM_OCR_CHAT_TEMPLATE),
}


def build_glm_tokenizer(special_tokens: tuple[str, ...] = GLM41V_SPECIAL_TOKENS) -> Tokenizer:
    """Byte-level BPE (GLM-4 split) plus the GLM special tokens after its vocab."""
    tok = train_byte_level_bpe(GLM_SPLIT, list(_CORPUS) * 10, vocab_size=600)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def build_glm4v_dir(out: Path, checkpoint: str = "glm4_1v") -> Path:
    """Write a GLM-V processor directory (tokenizer, template, image/video settings) to ``out``."""
    processor_class, image_type, video_type = GLM_CHECKPOINTS[checkpoint]
    special_tokens, template = GLM_TOKENS_AND_TEMPLATE[checkpoint]
    out.mkdir(parents=True, exist_ok=True)
    build_glm_tokenizer(special_tokens).save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "TokenizersBackend",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 65536,
            "clean_up_tokenization_spaces": False,
        },
    )
    (out / "chat_template.jinja").write_text(template, "utf-8")
    common = {
        "do_rescale": True,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "processor_class": processor_class,
    }
    image = {"size": {"shortest_edge": 12544, "longest_edge": 9633792}, "image_processor_type": image_type}
    write_json(out / "preprocessor_config.json", {**common, **image})
    video = {
        "size": {"shortest_edge": 12544, "longest_edge": 47040000},
        "fps": 2,
        "do_sample_frames": True,
        "video_processor_type": video_type,
    }
    write_json(out / "video_preprocessor_config.json", {**common, **video})
    write_json(out / "processor_config.json", {"processor_class": processor_class})
    model_type = "glm4v" if checkpoint == "glm4_1v" else "glm46v"
    architecture = "Glm4vForConditionalGeneration" if checkpoint == "glm4_1v" else "Glm46VForConditionalGeneration"
    write_json(out / "config.json", {"architectures": [architecture], "model_type": model_type})
    return out


GLM_VISION_TOKENS = {
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
}
# GLM-4.1V rotates half of each head (partial_rotary_factor 0.5) and splits the rotary
# half-dimension 32 as [8, 12, 12] over t/h/w; head_dim 16 here: 4 split as [2, 1, 1].
GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}


def glm_model_config(family: str, facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``Glm4vConfig`` / ``Glm46VConfig`` for ``facts``' processor (ids, patch 14, merge 2, temporal 2).

    The vision tower keeps the checkpoints' ``image_size`` 336: its learned 24x24 position grid
    is interpolated to each image's patch grid, whatever the processor's resize gives.
    """
    from transformers import Glm4vConfig, Glm46VConfig

    vision = {"depth": VISION_DEPTH, "hidden_size": VISION_HIDDEN, "num_heads": VISION_HEADS, "image_size": 336}
    vision |= {"intermediate_size": 2 * VISION_HIDDEN, "out_hidden_size": TEXT_HIDDEN, **patch_geometry(facts)}
    text = text_config(facts, rope_parameters=GLM_ROPE)
    text.pop("bos_token_id")  # Glm4vTextConfig has no BOS (the template writes [gMASK]<sop>)
    config_class = Glm4vConfig if family == "glm4v" else Glm46VConfig
    return config_class(
        text_config=text,
        vision_config=vision,
        **token_ids(facts, GLM_VISION_TOKENS),
        tie_word_embeddings=False,
        dtype="float32",
    )


# example family name -> (checkpoint, where its settings come from)
_EXAMPLES = {
    "glm4v": ("glm4_1v", "zai-org/GLM-4.1V-9B-Thinking (GLM-4.5V: same image settings and processor class)"),
    "glm46v": ("glm4_6v", "zai-org/GLM-4.6V / GLM-OCR (Glm46VProcessor; GLM-OCR chat template)"),
}
EXAMPLES = tuple(
    ExampleFamily(
        name=_name,
        build_processor=partial(build_glm4v_dir, checkpoint=_checkpoint),
        description=f"GLM special tokens (small BPE), chat template and image settings of {_source}",
        build_model=TinyModel(partial(glm_model_config, _name)),
    )
    for _name, (_checkpoint, _source) in _EXAMPLES.items()
)
