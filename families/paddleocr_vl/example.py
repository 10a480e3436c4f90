"""Example PaddleOCR-VL processor directory, built offline, and the tiny model ``train`` runs.

Settings of PaddlePaddle/PaddleOCR-VL (``preprocessor_config.json``): patch 14, merge 2,
temporal patch 1, ``min_pixels`` 147384, ``max_pixels`` 2822400, mean = std = 0.5, bicubic
(resample 3). Its ``chat_template.jinja``::

    <|begin_of_sentence|>[system text\\n]User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>...text\\n
    Assistant:\\nreply</s>

(all images of a user turn first, then its text; content must be a list of typed items).

The tokenizer is a small byte-level BPE in place of ERNIE-4.5's SentencePiece, carrying the
ERNIE specials ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 at their real ids, then
``<|begin_of_sentence|>`` / ``<|end_of_sentence|>`` (ERNIE's cls / sep), then added tokens in
the relative order of the upstream ids: ``<|IMAGE_PLACEHOLDER|>`` (100295 upstream, the config's
``image_token_id``), ``<|AUDIO_PLACEHOLDER|>``, ``<|LOC_0|>`` .. ``<|LOC_1000|>``,
``<|IMAGE_START|>`` / ``<|IMAGE_END|>`` (101305 / 101306, ``vision_start`` / ``vision_end``),
``<|VIDEO_START|>``, ``<|VIDEO_END|>``. Ids differ from the real vocabulary, the token structure
(specials, template, placeholder) does not. The processor takes no video (``PaddleOCRVLProcessor`` has no video
processor), so neither does the example.

Sources (the hub files could not be read offline): the image settings as candle's PaddleOCR-VL
example quotes them "from preprocessor_config.json" (147384 / 2822400, [-1, 1] normalisation);
the chat template as a published copy of the checkpoint's ``chat_template.jinja`` gives it
(``Assistant:\\n``; some third-party copies of an older revision write ``Assistant: ``).

Provenance: image settings as huggingface/candle ``candle-examples/examples/paddleocr-vl/main.rs``
@ 2c4d4407 quotes them "from preprocessor_config.json" (patch 14, merge 2, 147384 / 2822400
pixels, [-1, 1] normalisation); transformers' class defaults differ (384 * 384 / 1536 * 1536), so
these are the checkpoint's. The chat template equals character for character a copy in the code
index whose header says it is copied from PaddlePaddle/PaddleOCR-VL (index file 70290682601;
the index does not name its repository), and the structure of a second, older copy (an OpenVINO
notebook's, ``Assistant: `` and an ``image_token`` variable) apart from those two revisions' known
differences. ERNIE special tokens and their ids: not verified against the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer

from families.example.base import ExampleFamily, write_json
from families.example.model import (
    HEAD_DIM,
    VISION_DEPTH,
    VISION_HEADS,
    VISION_HIDDEN,
    ProcessorFacts,
    TinyModel,
    text_config,
)
from families.example.tokenizer import QWEN2_PRETOKENIZE_REGEX, train_byte_level_bpe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT = "PaddlePaddle/PaddleOCR-VL"
IMAGE_TOKEN = "<|IMAGE_PLACEHOLDER|>"
IMAGE_START = "<|IMAGE_START|>"
IMAGE_END = "<|IMAGE_END|>"
BASE_SPECIALS = ("<unk>", "<s>", "</s>")  # ERNIE-4.5 ids 0, 1, 2
ADDED_TOKENS = (
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    IMAGE_TOKEN,
    "<|AUDIO_PLACEHOLDER|>",
    *(f"<|LOC_{i}|>" for i in range(1001)),
    IMAGE_START,
    IMAGE_END,
    "<|VIDEO_START|>",
    "<|VIDEO_END|>",
)
CORPUS = (
    "OCR: Table Recognition: Formula Recognition: Chart Recognition: Text Spotting:",
    "Describe the image in detail. What is in this picture? A cat sitting on a red table.",
    "User: Assistant: Picture 1: invoice total 1234.56 EUR, date 2025-10-16",
    "\\frac{a}{b} = \\sum_{i=0}^{n} x_i <fcel>cell<lcel><nl> | col | row |",
    "这是一张发票。表格识别 公式识别 图表识别 文字识别",
)
# PaddlePaddle/PaddleOCR-VL chat_template.jinja.
PADDLEOCR_VL_CHAT_TEMPLATE = r"""{%- if not add_generation_prompt is defined -%}
    {%- set add_generation_prompt = true -%}
{%- endif -%}
{%- if not cls_token is defined -%}
    {%- set cls_token = "<|begin_of_sentence|>" -%}
{%- endif -%}
{%- if not eos_token is defined -%}
    {%- set eos_token = "</s>" -%}
{%- endif -%}
{{- cls_token -}}
{%- for message in messages -%}
    {%- if message["role"] == "user" -%}
        {{- "User: " -}}
        {%- for content in message["content"] -%}
            {%- if content["type"] == "image" -%}
                {{ "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>" }}
            {%- endif -%}
        {%- endfor -%}
        {%- for content in message["content"] -%}
            {%- if content["type"] == "text" -%}
                {{ content["text"] }}
            {%- endif -%}
        {%- endfor -%}
        {{ "\n" -}}
    {%- elif message["role"] == "assistant" -%}
        {{- "Assistant:\n" -}}
        {%- for content in message["content"] -%}
            {%- if content["type"] == "text" -%}
                {{ content["text"] }}
            {%- endif -%}
        {%- endfor -%}
        {{ eos_token -}}
    {%- elif message["role"] == "system" -%}
        {%- for content in message["content"] -%}
            {%- if content["type"] == "text" -%}
                {{ content["text"] + "\n" }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "Assistant:\n" -}}
{%- endif -%}
"""
# PaddlePaddle/PaddleOCR-VL preprocessor_config.json.
IMAGE_SETTINGS = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "PaddleOCRVLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_pixels": 2822400,
    "merge_size": 2,
    "min_pixels": 147384,
    "patch_size": 14,
    "processor_class": "PaddleOCRVLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "temporal_patch_size": 1,
}


def build_paddleocr_tokenizer() -> Tokenizer:
    """Byte-level BPE with ERNIE's ids 0..2 special, then the PaddleOCR-VL added tokens after its vocab."""
    tok = train_byte_level_bpe(QWEN2_PRETOKENIZE_REGEX, list(CORPUS) * 10, vocab_size=600, special_tokens=BASE_SPECIALS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_TOKENS])
    return tok


def build_paddleocr_vl_dir(out: Path) -> Path:
    """Write the PaddleOCR-VL processor directory (tokenizer, template, image settings) to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    build_paddleocr_tokenizer().save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "TokenizersBackend",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "cls_token": "<|begin_of_sentence|>",
            "sep_token": "<|end_of_sentence|>",
            "extra_special_tokens": {"image_token": IMAGE_TOKEN},
            "model_max_length": 131072,
            "clean_up_tokenization_spaces": False,
        },
    )
    (out / "chat_template.jinja").write_text(PADDLEOCR_VL_CHAT_TEMPLATE, "utf-8")
    write_json(out / "preprocessor_config.json", IMAGE_SETTINGS)
    write_json(out / "processor_config.json", {"processor_class": "PaddleOCRVLProcessor"})
    write_json(
        out / "config.json", {"architectures": ["PaddleOCRVLForConditionalGeneration"], "model_type": "paddleocr_vl"}
    )
    return out


# The rotary half-dimension 8 (head_dim 16) split over t/h/w as the checkpoint splits 64 as [16, 24, 24].
PADDLEOCR_ROPE = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3]}


def paddleocr_vl_config(facts: ProcessorFacts) -> PretrainedConfig:
    """Tiny ``PaddleOCRVLConfig`` for ``facts``' processor (patch 14, merge 2, the placeholder ids).

    The vision tower keeps the checkpoint's ``image_size`` 384: its learned 27x27 position grid
    is interpolated to each image's patch grid. ``video_token_id`` points at ``<|VIDEO_START|>``:
    the processor never writes it (no video), the config only needs an id.
    """
    from transformers import PaddleOCRVLConfig

    image = facts.image
    vision = {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_hidden_layers": VISION_DEPTH,
        "num_attention_heads": VISION_HEADS,
        "patch_size": int(image["patch_size"]),
        "spatial_merge_size": int(image["merge_size"]),
        "image_size": 384,
    }
    text = text_config(facts, rope_parameters=PADDLEOCR_ROPE, head_dim=HEAD_DIM, use_bias=False)
    return PaddleOCRVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=facts.token_id(IMAGE_TOKEN),
        video_token_id=facts.token_id("<|VIDEO_START|>"),
        vision_start_token_id=facts.token_id(IMAGE_START),
        vision_end_token_id=facts.token_id(IMAGE_END),
        tie_word_embeddings=True,
        dtype="float32",
    )


EXAMPLES = (
    ExampleFamily(
        name="paddleocr_vl",
        build_processor=build_paddleocr_vl_dir,
        description=f"ERNIE specials (small BPE), chat template and image settings of {CHECKPOINT}",
        build_model=TinyModel(paddleocr_vl_config),
    ),
)
