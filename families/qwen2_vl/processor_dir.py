"""Write a weightless, HF-loadable Qwen-VL processor directory (tokenizer, templates, configs).

The tokenizer is a small byte-level BPE trained here (see :mod:`families.example.tokenizer`)
plus the real Qwen special tokens; the chat templates and image/video settings are those
of the published checkpoints. Token *ids* therefore differ from the real models, token
*structure* (specials, template, media placeholders) does not.

Output of ``build_processor_dir(out, "qwen2_vl")``::

    out/tokenizer.json                  BPE, vocab 3000 + 14 added specials (+2 for qwen3_vl)
    out/tokenizer_config.json           Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>
    out/chat_template.jinja             the Qwen2-VL-7B-Instruct template
    out/preprocessor_config.json        Qwen2VLImageProcessor, patch 14, 3136..12845056 px
    out/video_preprocessor_config.json  Qwen2VLVideoProcessor, 3136..12845056 px
    out/config.json                     model_type + vision token ids, no weights

transformers 5.23 without torchvision cannot build the video processor, so
``AutoProcessor.from_pretrained(out)`` raises ImportError there; ``AutoTokenizer`` and
``AutoImageProcessor.from_pretrained(out, backend="pil")`` work.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from families.example.templates import CHAT_TEMPLATES
from families.example.tokenizer import build_tokenizer, tokenizer_config

logger = logging.getLogger(__name__)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _image_config(family: str) -> dict[str, Any]:
    if family == "qwen3_vl":
        return {
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "merge_size": 2,
            "patch_size": 16,
            "processor_class": "Qwen3VLProcessor",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "temporal_patch_size": 2,
        }
    return {
        "image_mean": OPENAI_CLIP_MEAN,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": OPENAI_CLIP_STD,
        "max_pixels": 12845056,
        "merge_size": 2,
        "min_pixels": 3136,
        "patch_size": 14,
        "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "size": {"longest_edge": 12845056, "shortest_edge": 3136},
        "temporal_patch_size": 2,
    }


def _video_config(family: str) -> dict[str, Any]:
    """Video settings the real checkpoints load.

    Qwen2-VL/2.5-VL ship no video_preprocessor_config.json, so transformers falls back to
    preprocessor_config.json: video pixels 3136..12845056, no frame sampling unless asked.
    Qwen3-VL ships its own file (4096..25165824 px); fps/min/max frames are class defaults.
    """
    if family == "qwen3_vl":
        return {
            "do_sample_frames": True,
            "fps": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "max_frames": 768,
            "merge_size": 2,
            "min_frames": 4,
            "patch_size": 16,
            "processor_class": "Qwen3VLProcessor",
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "temporal_patch_size": 2,
            "video_processor_type": "Qwen3VLVideoProcessor",
        }
    image = _image_config(family)
    return {
        "do_sample_frames": False,
        "image_mean": image["image_mean"],
        "image_std": image["image_std"],
        "max_frames": 768,
        "merge_size": 2,
        "min_frames": 4,
        "patch_size": 14,
        "processor_class": image["processor_class"],
        "size": {"longest_edge": 12845056, "shortest_edge": 3136},
        "temporal_patch_size": 2,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }


def _model_config(family: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """Just enough config.json for Auto* class resolution; there are no weights."""
    tokens = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    tokens |= {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
    ids = {f"{name}_token_id": tokenizer.token_to_id(tok) for name, tok in tokens.items()}
    return {
        "architectures": [
            {
                "qwen2_vl": "Qwen2VLForConditionalGeneration",
                "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3_vl": "Qwen3VLForConditionalGeneration",
            }[family]
        ],
        "model_type": family,
        **ids,
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def build_processor_dir(out_dir: Path, family: str = "qwen2_vl") -> Path:
    """Write a processor directory for ``family``; same arguments give the same bytes.

    Args:
        out_dir: Directory to create or overwrite files in.
        family: One of ``FAMILIES``.

    Returns:
        ``out_dir``, loadable with ``AutoTokenizer`` / ``AutoImageProcessor``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", "utf-8")
    first_added_id = tokenizer.get_vocab_size(with_added_tokens=False)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(family, first_added_id))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATES[family], "utf-8")
    _write_json(out_dir / "preprocessor_config.json", _image_config(family))
    _write_json(out_dir / "video_preprocessor_config.json", _video_config(family))
    _write_json(out_dir / "config.json", _model_config(family, tokenizer))
    logger.info("wrote %s processor to %s", family, out_dir)
    return out_dir
