"""Example GLM-4.1V / 4.5V / 4.6V processor directory, built offline.

A small byte-level BPE with the GLM-4 pre-tokenizer split (cl100k-style, digits in runs of up
to 3) carries the GLM special tokens in their upstream order, right after the BPE vocab
(``<|endoftext|>``, ``[MASK]``, ``[gMASK]``, ``[sMASK]``, ``<sop>``, ``<eop>``, ``<|system|>``,
``<|user|>``, ``<|assistant|>``, ``<|observation|>``, ``<|begin_of_image|>``,
``<|end_of_image|>``, ``<|begin_of_video|>``, ``<|end_of_video|>``, ``<|image|>``,
``<|video|>``: 151329..151344 in zai-org/GLM-4.1V-9B-Thinking). Settings:

- ``glm4_1v``: zai-org/GLM-4.1V-9B-Thinking (and GLM-4.5V, which ships the same image settings
  and processor class): ``Glm4vProcessor``; ``preprocessor_config.json`` patch 14, temporal 2,
  merge 2, ``size`` shortest_edge 12544 / longest_edge 9633792, CLIP mean/std;
  ``video_preprocessor_config.json`` ``size`` 12544 / 47040000 (the class default), fps 2.
- ``glm4_6v``: zai-org/GLM-4.6V (and GLM-OCR): ``Glm46VProcessor`` with
  ``Glm46VImageProcessor`` and the same numbers.

Chat template: GLM-4.1V-9B-Thinking's ``chat_template.jinja`` (revision 3c1471e5), verbatim:
``[gMASK]<sop>`` then ``<|user|>\\n`` ... ``<|begin_of_image|><|image|><|end_of_image|>`` per
image ... ``<|assistant|>\\n`` reply. GLM-4.5V/4.6V templates add tool and thinking blocks
around the same image placeholder; ``glm4_6v`` uses the 4.1V template too.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from prep.example.families.base import ExampleFamily, register_example_family

GLM_SPECIAL_TOKENS = (
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
    "<|image|>",
    "<|video|>",
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
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# checkpoint -> (processor class, image processor type, video processor type)
GLM_CHECKPOINTS: dict[str, tuple[str, str, str]] = {
    "glm4_1v": ("Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
    "glm4_6v": ("Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor"),
}


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", "utf-8")


def build_glm_tokenizer() -> Tokenizer:
    """Byte-level BPE (GLM-4 split) plus the GLM special tokens after its vocab."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(_CORPUS) * 10, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL_TOKENS])
    return tok


def build_glm4v_dir(out: Path, checkpoint: str = "glm4_1v") -> Path:
    """Write a GLM-V processor directory (tokenizer, template, image/video settings) to ``out``."""
    processor_class, image_type, video_type = GLM_CHECKPOINTS[checkpoint]
    out.mkdir(parents=True, exist_ok=True)
    build_glm_tokenizer().save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "TokenizersBackend",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 65536,
            "clean_up_tokenization_spaces": False,
        },
    )
    (out / "chat_template.jinja").write_text(GLM41V_CHAT_TEMPLATE, "utf-8")
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
    _write_json(out / "preprocessor_config.json", {**common, **image})
    video = {
        "size": {"shortest_edge": 12544, "longest_edge": 47040000},
        "fps": 2,
        "do_sample_frames": True,
        "video_processor_type": video_type,
    }
    _write_json(out / "video_preprocessor_config.json", {**common, **video})
    _write_json(out / "processor_config.json", {"processor_class": processor_class})
    model_type = "glm4v" if checkpoint == "glm4_1v" else "glm46v"
    architecture = "Glm4vForConditionalGeneration" if checkpoint == "glm4_1v" else "Glm46VForConditionalGeneration"
    _write_json(out / "config.json", {"architectures": [architecture], "model_type": model_type})
    return out


# example family name -> (checkpoint, where its settings come from)
_EXAMPLES = {
    "glm4v": ("glm4_1v", "zai-org/GLM-4.1V-9B-Thinking (GLM-4.5V: same image settings and processor class)"),
    "glm46v": ("glm4_6v", "zai-org/GLM-4.6V (Glm46VProcessor; GLM-4.1V-9B-Thinking chat template)"),
}
for _name, (_checkpoint, _source) in _EXAMPLES.items():
    register_example_family(
        ExampleFamily(
            name=_name,
            build_processor=partial(build_glm4v_dir, checkpoint=_checkpoint),
            description=f"GLM special tokens (small BPE), chat template and image settings of {_source}",
        )
    )
