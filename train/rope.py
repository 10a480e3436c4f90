"""Per-sample rotary positions for a packed row, with the model family's own rope rule.

Qwen-VL models number a whole row with ``get_rope_index``; in a pack that would make every
sample continue the previous one's positions (and transformers would miss the packing). So
each sample's own ids and grids go through the family's ``get_rope_index`` alone, and the
results are laid out slot by slot. Layout for a VL model (``[4, 1, T]``)::

    slot            | sample 0 (3 real + 1 pad)   | sample 1 (2 real + 2 pad) |
    row 0 (text)    | 0  1  2  3                  | 0  1  2  3                |  restarts per slot
    rows 1-3 (thw)  | get_rope_index(sample 0), m+1 | get_rope_index(sample 1), m+1, m+2 |

where pad tokens continue from the sample's largest rope position ``m`` (what transformers'
``rope_deltas`` would give the next token). Families with 1-D rotary positions (LLaVA,
Pixtral / Mistral 3, InternVL, Idefics3, Gemma 3, text-only models) get ``[1, T]``: row 0
alone. Which rule a family follows is its layout's ``rope`` (`families/<name>/layout.py`); the arguments of
``get_rope_index`` are bound by the installed signature (the Omni thinkers' differs).

``get_rope_index`` reads only the config (merge size, tokens per second), never a weight, so
the model is built once on the meta device: no memory, ~0.2-3 s per worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig


def _family_rope_index(config: PretrainedConfig) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The bound ``get_rope_index`` of the family's model built on meta (the base model's, else its own)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    model_class: Any = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)  # typed loosely by transformers
    if model_class is None:
        raise TypeError(f"{type(config).__name__} is not an image-text-to-text config: it has no mRoPE index")
    with torch.device("meta"):
        model = model_class._from_config(config)
    for owner in (getattr(model, "model", None), model):
        if owner is not None and hasattr(owner, "get_rope_index"):
            return owner.get_rope_index
    raise TypeError(f"{model_class.__name__} has no get_rope_index: its family is not an mRoPE family")


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeIndex:
    """Positions for packed rows of one model family; pure given it."""

    mm_token_ids: Mapping[int, int]  # mm_token_type_ids value (IMAGE, VIDEO) -> placeholder token id
    rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None  # None: 1-D positions
    #: the parameter names of ``rope_index`` in the installed transformers (arguments bound by name)
    parameters: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, mrope: bool, mm_token_ids: Mapping[int, int]) -> RopeIndex:
        """Build the family's rope function once (``mrope``), reading the token ids of the data."""
        if not mrope:
            return cls(mm_token_ids=dict(mm_token_ids), rope_index=None)
        fn = _family_rope_index(config)
        return cls(
            mm_token_ids=dict(mm_token_ids), rope_index=fn, parameters=frozenset(inspect.signature(fn).parameters)
        )

    @property
    def multimodal(self) -> bool:
        return self.rope_index is not None

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image placeholder, 2 video placeholder, as the processor returns them."""
        out = torch.zeros_like(input_ids, dtype=torch.int64)
        for value, token_id in self.mm_token_ids.items():
            out[input_ids == token_id] = value
        return out

    def sample_positions(self, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[3, L]`` rope positions of one sample (its real tokens only) from the family's rule.

        Arguments are bound by the installed ``get_rope_index``'s own parameter names: the ids,
        ``mm_token_type_ids`` where it takes them, an all-ones ``attention_mask`` (the sample
        alone, unpadded: the Omni thinkers' index reads it for text-only samples) and the
        sample's vision keywords it reads (grids, ``second_per_grid_ts``).
        """
        if self.rope_index is None:
            raise TypeError("this family has no multimodal rope index")
        ids = input_ids[None].to(torch.int64)
        available = {
            "input_ids": ids,
            "mm_token_type_ids": self.mm_token_type_ids(ids),
            "attention_mask": torch.ones_like(ids),
            **media,
        }
        positions, _ = self.rope_index(**{k: v for k, v in available.items() if k in self.parameters})
        return positions[:, 0]

    def positions(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: Sequence[int],
        cu_seqlens_padded: Sequence[int],
        media: Sequence[Mapping[str, torch.Tensor]],
    ) -> torch.Tensor:
        """Position ids of a packed row ``input_ids`` [T]: ``[4, 1, T]`` (mRoPE) or ``[1, T]``.

        Args:
            input_ids: The row, slot layout (sample i's real tokens start at cu_seqlens_padded[i]).
            cu_seqlens: Real-token boundaries [S+1].
            cu_seqlens_padded: Slot boundaries [S+1]; its last value is T.
            media: Per sample, its vision keywords (ignored for 1-D positions).
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
