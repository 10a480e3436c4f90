"""The family's own Hugging Face vision tower and projector, for a megatron-core language model.

`train megatron` keeps the language model in megatron-core and takes the vision side from
transformers, as Megatron-Bridge's HF-encoder models do (``Qwen25VLModel``, ``Ministral3Model``:
the HF tower built from the HF config, HF's ``get_image_features`` bound to it). Here the HF
base model class itself (``Qwen2_5_VLModel``, ``Mistral3Model``, ``LlavaModel``,
``LlavaOnevisionModel``, ...) is built from the model's config with an empty language model
(no layers, a one-row vocabulary), which is then dropped: what remains is exactly the family's
vision tower, projector and extras (LLaVA-OneVision's ``image_newline``), with the family's own
``get_image_features`` / ``get_video_features`` on them. No vision code is copied, so the image
embeddings are the HF model's, bit for bit (tested against the full model).

`HFVisionEncoder.embeddings` takes ``PackedBatch.vision`` (the HF forward's vision keywords for
the row, images in token order, as the family's `train.families` layout makes them) and returns,
per placeholder token id, one embedding row per placeholder token in row order. `media_rows` and
`scatter_media` put them into megatron-core's ``decoder_input`` (``[T, 1, H]``, sequence first).
Example, image token ``I``, a pack of a text sample, a one-image sample and a two-image sample
(images of 2, 1 and 2 tokens), ``--pad-to-multiple-of 4``::

    input_ids   [t t t P | t I I t | t I t I I t P P]
    rows of I   [5 6 | 9 | 11 12]                       image 0 -> rows 5, 6; image 1 -> 9; image 2 -> 11, 12
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModel, PretrainedConfig

from packvlm.errors import InternalError, UsageError

#: HF model types whose language model is a plain decoder a megatron-core GPTModel stands in for,
#: with the rope rule megatron-core applies ("mrope": t/h/w sections; "rope": 1-D)
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen2_vl": "mrope",
    "qwen2_5_vl": "mrope",
    "mistral3": "rope",
    "llava": "rope",  # Pixtral-12B
    "llava_onevision": "rope",
    "llava_next": "rope",
}
#: why the others are refused (the language model is not a plain decoder over merged embeddings)
UNSUPPORTED_REASONS: dict[str, str] = {
    "qwen3_vl": "Qwen3-VL adds deepstack vision features inside the decoder layers",
    "qwen3_vl_moe": "Qwen3-VL adds deepstack vision features inside the decoder layers",
    "gemma3": "Gemma 3 attends bidirectionally inside image blocks",
    "glm4v": "GLM-4V rotates only part of each head (partial rotary) with its own mRoPE",
    "glm4v_moe": "GLM-4V rotates only part of each head (partial rotary) with its own mRoPE",
}


class VisionFamilyError(UsageError, ValueError):
    """The model family's vision side cannot be paired with a megatron-core GPT language model."""


class MediaTokenMismatchError(InternalError, ValueError):
    """A row has another number of placeholder tokens than the vision tower gave embeddings."""


def unsupported_reason(config: PretrainedConfig) -> str | None:
    """Why the images of this HF config cannot train with a megatron-core language model; None if they can."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "vision_config", None) is None:
        return f"model type {model_type!r} has no vision_config: the model is text-only"
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = UNSUPPORTED_REASONS.get(model_type, "its vision side is not wired to megatron-core here")
        return f"model type {model_type!r}: {why}"
    return None


def vision_rope(config: PretrainedConfig) -> str:
    """The rope rule (``"mrope"`` or ``"rope"``) of a supported VLM config.

    Raises:
        VisionFamilyError: the config has no vision part, or its family is not supported (why, and what to use).
    """
    reason = unsupported_reason(config)
    if reason is not None:
        raise VisionFamilyError(
            f"`train megatron` cannot train images for {reason}. Supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}. Use `train hf`, or --ignore-media to train the text only."
        )
    return SUPPORTED_MODEL_TYPES[config.model_type]


class HFVisionEncoder(torch.nn.Module):
    """The HF base model of ``config`` without its language model: vision tower, projector, extras.

    Parameters are named as in the HF model under ``model.`` (``model.visual.blocks.0...``,
    ``model.vision_tower...``, ``model.multi_modal_projector...``), so an HF state dict's vision
    keys load with the ``model.`` prefix kept. Initialised by transformers from the torch RNG.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision_rope(config)  # refuses unsupported families by name
        hollow = copy.deepcopy(config)
        text = hollow.get_text_config()
        text.num_hidden_layers = 0  # the language model is megatron-core's: build none of it here
        text.vocab_size = 1
        text.pad_token_id = None
        self.model = AutoModel.from_config(hollow)
        del self.model.language_model
        self.image_token_id = int(config.image_token_id)
        video = getattr(config, "video_token_id", None)
        self.video_token_id = None if video is None else int(video)

    @property
    def hidden_size(self) -> int:
        """Width of the embeddings it writes (the language model's hidden size)."""
        return int(self.model.config.get_text_config().hidden_size)

    def embeddings(self, vision: Mapping[str, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """``(placeholder token id, [N, H] embeddings in token order)`` per modality present in ``vision``."""
        out = []
        if vision.get("pixel_values") is not None:
            out.append((self.image_token_id, self._features(self.model.get_image_features, vision)))
        if vision.get("pixel_values_videos") is not None:
            if self.video_token_id is None:
                raise VisionFamilyError(f"model type {self.model.config.model_type!r} takes no videos")
            out.append((self.video_token_id, self._features(self.model.get_video_features, vision)))
        return out

    @staticmethod
    def _features(method: Any, vision: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The HF method called with the keywords it takes; its per-item outputs joined in order."""
        accepted = inspect.signature(method).parameters
        output = method(**{k: v for k, v in vision.items() if k in accepted}, return_dict=True)
        pooled = output.pooler_output
        return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])


def media_rows(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """Row positions (int64 ``[N]``, ascending) of ``token_id`` in the ``[1, T]`` row."""
    return torch.nonzero(input_ids.reshape(-1) == token_id).reshape(-1)


def scatter_media(
    decoder_input: torch.Tensor, input_ids: torch.Tensor, embeddings: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """``decoder_input`` ``[T, 1, H]`` with each modality's embeddings at its placeholder rows (out of place).

    The k-th embedding row goes to the k-th placeholder token of the row, as transformers'
    ``masked_scatter`` does for one sample: the layouts keep media in token order, so every
    placeholder gets its own image's embedding.

    Raises:
        MediaTokenMismatchError: the row's placeholder count differs from the embedding rows.
    """
    out = decoder_input
    for token_id, features in embeddings:
        rows = media_rows(input_ids, token_id).to(decoder_input.device)
        if rows.numel() != features.shape[0]:
            raise MediaTokenMismatchError(
                f"the row holds {rows.numel()} placeholder tokens {token_id} but the vision tower gave "
                f"{features.shape[0]} embeddings: the pack's media and text disagree"
            )
        column = torch.zeros_like(rows)
        out = out.index_put((rows, column), features.to(dtype=out.dtype, device=out.device))
    return out
