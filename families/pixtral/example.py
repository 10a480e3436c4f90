"""Pixtral / Mistral 3 example processors: offline ``PixtralProcessor`` directories.

Each directory holds a small byte-level BPE that carries the Mistral special tokens at their real
ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3, ``[/INST]`` 4, ``[IMG]`` 10,
``[IMG_BREAK]`` 12, ``[IMG_END]`` 13, ...) and a checkpoint's settings and template:

- ``pixtral_12b`` (``prep example --family pixtral``): mistral-community/pixtral-12b
  (preprocessor_config.json: patch 16, ``size.longest_edge`` 1024; processor_config.json:
  patch_size 16, no spatial merge) and its chat template (``<s>[INST]...[IMG]...[/INST]reply</s>``).
- ``mistral_small_3_1`` (``--family mistral3``): mistralai/Mistral-Small-3.1-24B-Instruct-2503
  (also Ministral 3: patch 14, ``longest_edge`` 1540, processor patch_size 14,
  ``spatial_merge_size`` 2) and its ``[SYSTEM_PROMPT]`` template, with the default system
  prompt's date left out so renders are deterministic.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import processors

from families.example.base import ExampleFamily, write_json
from families.example.model import HEAD_DIM, ProcessorFacts, TinyModel, text_config, vision_config
from families.example.tokenizer import train_byte_level_bpe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The first 20 ids of the Mistral (tekken) vocabularies, in order.
SPECIALS = (
    "<unk> <s> </s> [INST] [/INST] [AVAILABLE_TOOLS] [/AVAILABLE_TOOLS] [TOOL_RESULTS] [/TOOL_RESULTS] "
    "[TOOL_CALLS] [IMG] <pad> [IMG_BREAK] [IMG_END] [PREFIX] [MIDDLE] [SUFFIX] [SYSTEM_PROMPT] "
    "[/SYSTEM_PROMPT] [TOOL_CONTENT]"
).split()
# The tekken pre-tokenizer split (pixtral-12b tokenizer.json), then byte-level symbols.
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "Describe the image in detail.",
    "What is in this picture? A cat sitting on a red table.",
    "Compare both images: left, right, top and bottom.",
    "abc IMG INST image break end 0123456789 [brackets] (parens)",
    "The second photo shows a dog. Where is the tree? Next to the house.",
]
PIXTRAL_12B_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\\n\\n" }}
        {%- else %}
            {{- "[INST]" }}
        {%- endif %}
        {%- if message["content"] is not string %}
            {%- for chunk in message["content"] %}
                {%- if chunk["type"] == "text" %}
                    {{- chunk["text"] }}
                {%- elif chunk["type"] == "image" %}
                    {{- "[IMG]" }}
                {%- else %}
                    {{- raise_exception("Unrecognized content type!") }}
                {%- endif %}
            {%- endfor %}
        {%- else %}
            {{- message["content"] }}
        {%- endif %}
        {{- "[/INST]" }}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501
MISTRAL_SMALL_TEMPLATE = """{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI." %}
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content'] %}
    {%- else %}
        {%- set system_message = messages[0]['content'][0]['text'] %}
    {%- endif %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system_message %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if message['content'] is string %}
            {{- '[INST]' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST]' }}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- else %}
                    {{- raise_exception('Only text and image blocks are supported in message content!') }}
                {%- endif %}
            {%- endfor %}
            {{- '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'system' %}
        {%- if message['content'] is string %}
            {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
        {%- else %}
            {{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] is string %}
            {{- message['content'] + eos_token }}
        {%- else %}
            {{- message['content'][0]['text'] + eos_token }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Only user, system and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501
# checkpoint -> (vision patch, spatial merge, longest edge, template)
CHECKPOINTS = {
    "pixtral_12b": (16, 1, 1024, PIXTRAL_12B_TEMPLATE),  # mistral-community/pixtral-12b
    "mistral_small_3_1": (14, 2, 1540, MISTRAL_SMALL_TEMPLATE),  # mistralai/Mistral-Small-3.1-24B-Instruct-2503
}


def build_processor_dir(out: Path, checkpoint: str) -> Path:
    """Write the ``checkpoint`` (a key of ``CHECKPOINTS``) processor directory to ``out``."""
    patch, merge, longest_edge, template = CHECKPOINTS[checkpoint]
    tok = train_byte_level_bpe(TEKKEN_SPLIT, CORPUS * 10, vocab_size=700, special_tokens=SPECIALS, unk_token="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    write_json(out / "tokenizer_config.json", {"tokenizer_class": "TokenizersBackend", **tokenizer_config})
    write_json(
        out / "preprocessor_config.json",
        {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_processor_type": "PixtralImageProcessor",
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "patch_size": {"height": patch, "width": patch},
            "processor_class": "PixtralProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": longest_edge},
        },
    )
    processor_config: dict[str, Any] = {
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "image_token": "[IMG]",
        "patch_size": patch,
        "processor_class": "PixtralProcessor",
    }
    if merge != 1:
        processor_config["spatial_merge_size"] = merge
    write_json(out / "processor_config.json", processor_config)
    (out / "chat_template.jinja").write_text(template, "utf-8")
    return out


def pixtral_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny Pixtral (mistral-community/pixtral-12b): ``LlavaConfig`` with a Pixtral vision tower and a Mistral decoder.

    The tower's ``patch_size`` is the processor's; its ``image_size`` (the largest side its 2D
    rotary covers) is the processor's ``longest_edge``. ``[IMG]`` is the image token; one
    feature per patch (no merge), every patch kept (``vision_feature_select_strategy`` "full").
    """
    from transformers import LlavaConfig

    if int(facts.processor.get("spatial_merge_size", 1)) != 1:
        raise ValueError(f"{facts.path}: a Pixtral processor merges no patches; this one is Mistral 3's")
    return LlavaConfig(
        text_config=_mistral_text(facts),
        vision_config=_pixtral_vision(facts),
        image_token_index=facts.token_id(str(facts.processor["image_token"])),
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        dtype="float32",
    )


def mistral3_model_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny Mistral 3 (Mistral-Small-3.1 / Ministral 3): ``Mistral3Config``, Pixtral tower, 2x2 patch merger.

    ``spatial_merge_size`` is the processor's: each image token stands for merge x merge patches.
    """
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config=_mistral_text(facts),
        vision_config=_pixtral_vision(facts),
        image_token_index=facts.token_id(str(facts.processor["image_token"])),
        spatial_merge_size=int(facts.processor["spatial_merge_size"]),
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _mistral_text(facts: ProcessorFacts) -> dict[str, Any]:
    return text_config(facts, model_type="mistral", head_dim=HEAD_DIM, sliding_window=None, rope_theta=1_000_000_000.0)


def _pixtral_vision(facts: ProcessorFacts) -> dict[str, Any]:
    patch = int(facts.processor["patch_size"])
    if int(facts.image["patch_size"]["height"]) != patch:
        raise ValueError(f"{facts.path}: image processor and processor disagree on the patch size")
    return vision_config(model_type="pixtral", patch_size=patch, image_size=int(facts.image["size"]["longest_edge"]))


_MODELS = {"pixtral": pixtral_model_config, "mistral3": mistral3_model_config}
EXAMPLES = tuple(
    ExampleFamily(
        name=_name,
        build_processor=partial(build_processor_dir, checkpoint=_checkpoint),
        description=f"Mistral special ids, chat template and image settings of {_source}",
        build_model=TinyModel(_MODELS[_name]),
    )
    for _name, _checkpoint, _source in (
        ("pixtral", "pixtral_12b", "mistral-community/pixtral-12b"),
        ("mistral3", "mistral_small_3_1", "mistralai/Mistral-Small-3.1-24B-Instruct-2503 (Ministral 3 alike)"),
    )
)
