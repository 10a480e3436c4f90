"""Per-sample rotary positions for a packed row, with the model family's own rope rule.

Qwen-VL models number a whole row with ``get_rope_index``; in a pack that would make every
sample continue the previous one's positions (and transformers would miss the packing). So
each sample's own ids and grids go through the family's ``get_rope_index`` alone, and the
results are laid out slot by slot. Layout for a VL model (``[4, 1, T]``)::

    slot            | sample 0 (3 real + 1 pad)   | sample 1 (2 real + 2 pad) |
    row 0 (text)    | 0  1  2  3                  | 0  1  2  3                |  restarts per slot
    rows 1-3 (thw)  | get_rope_index(sample 0), m+1 | get_rope_index(sample 1), m+1, m+2 |

where pad tokens continue from the sample's largest rope position ``m`` (what transformers'
``rope_deltas`` would give the next token). Text-only configs get ``[1, T]``: row 0 alone.

``get_rope_index`` reads only the config (merge size, tokens per second), never a weight, so
the model is built once on the meta device: no memory, ~0.2-3 s per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids values


def _family_rope_index(config: PretrainedConfig) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The bound ``get_rope_index`` of the family's base model built on meta, or None (text-only)."""
    if getattr(config, "vision_config", None) is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    model_class: Any = MODEL_MAPPING.get(type(config), None)  # a model class; transformers types it loosely
    if model_class is None or not hasattr(model_class, "get_rope_index"):
        return None
    with torch.device("meta"):
        model = model_class._from_config(config)
    return model.get_rope_index


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleMedia:
    """One sample's grids in token order (None when it has none of that kind)."""

    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeIndex:
    """Positions for packed rows of one model config; pure given it."""

    image_token_id: int | None
    video_token_id: int | None
    rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None  # None: text-only model

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> RopeIndex:
        """Read the token ids and build the family's rope function once."""
        fn = _family_rope_index(config)
        image = getattr(config, "image_token_id", None)
        video = getattr(config, "video_token_id", None)
        return cls(image_token_id=image, video_token_id=video, rope_index=fn)

    @property
    def multimodal(self) -> bool:
        return self.rope_index is not None

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image placeholder, 2 video placeholder, as the processor returns them."""
        out = torch.zeros_like(input_ids, dtype=torch.int64)
        if self.image_token_id is not None:
            out[input_ids == self.image_token_id] = IMAGE
        if self.video_token_id is not None:
            out[input_ids == self.video_token_id] = VIDEO
        return out

    def sample_positions(self, input_ids: torch.Tensor, media: SampleMedia) -> torch.Tensor:
        """``[3, L]`` rope positions of one sample (its real tokens only) from the family's rule."""
        if self.rope_index is None:
            raise TypeError("a text-only config has no multimodal rope index")
        ids = input_ids[None].to(torch.int64)
        positions, _ = self.rope_index(
            ids,
            mm_token_type_ids=self.mm_token_type_ids(ids),
            image_grid_thw=media.image_grid_thw,
            video_grid_thw=media.video_grid_thw,
            second_per_grid_ts=media.second_per_grid_ts,
        )
        return positions[:, 0]

    def positions(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: Sequence[int],
        cu_seqlens_padded: Sequence[int],
        media: Sequence[SampleMedia],
    ) -> torch.Tensor:
        """Position ids of a packed row ``input_ids`` [T]: ``[4, 1, T]`` (VL) or ``[1, T]`` (text).

        Args:
            input_ids: The row, slot layout (sample i's real tokens start at cu_seqlens_padded[i]).
            cu_seqlens: Real-token boundaries [S+1].
            cu_seqlens_padded: Slot boundaries [S+1]; its last value is T.
            media: Per sample, its grids (ignored for text-only models).
        """
        total = int(cu_seqlens_padded[-1])
        text = torch.empty(total, dtype=torch.int64)
        rope = torch.empty(3, total, dtype=torch.int64) if self.multimodal else None
        for i in range(len(cu_seqlens) - 1):
            start, end = int(cu_seqlens_padded[i]), int(cu_seqlens_padded[i + 1])
            real = int(cu_seqlens[i + 1]) - int(cu_seqlens[i])
            text[start:end] = torch.arange(end - start)
            if rope is None:
                continue
            sample = self.sample_positions(input_ids[start : start + real], media[i])
            rope[:, start : start + real] = sample
            if end > start + real:  # pad tokens continue after the sample's largest position
                nxt = int(sample.max()) + 1 if real else 0
                rope[:, start + real : end] = torch.arange(nxt, nxt + end - start - real)
        if rope is None:
            return text[None]
        return torch.cat([text[None], rope])[:, None, :]
