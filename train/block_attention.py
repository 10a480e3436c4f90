"""Packed attention with bidirectional image blocks (Gemma 3) and sliding windows, exact.

transformers 5.24 builds Gemma 3's masks for one unpadded sample in
``modeling_gemma3.create_masks_for_vision_model`` from ``token_type_ids`` (one group per
maximal run of image tokens, ``get_block_sequence_ids_for_mask``)::

    full layers      causal OR same block                       (create_causal_mask, block_sequence_ids)
    sliding layers   (causal OR same block) AND kv > q - window (or_mask_function=blockwise_overlay,
                                                                 and_mask_function=sliding_window_overlay)

so on a sliding layer an image token sees every *later* token of its block (``kv > q -
window`` always holds for kv > q) but only the last ``window - 1`` earlier ones. In a packed
row, with ``q`` and ``kv`` row indices, the same rule holds per slot::

    allowed(q, kv) = same slot AND (kv <= q OR (same block AND block >= 0)) [AND kv > q - window]

Row-index distances equal the sample's own position distances inside a slot, so the window is
the model's. Blocks come from the batch (`train.batch.PackedBatch.image_blocks`), never from
the token ids here. Without blocks the rule is the plain causal (sliding-window) mask that
`train.attention` serves with varlen kernels.

Two executions of the one rule (:func:`allowed`):

    CUDA   torch.nn.attention.flex_attention (compiled) with a BlockMask built once per
           micro-batch and window from per-token slot and block ids (create_block_mask,
           compiled): no dense T x T mask, fully masked 128 x 128 tiles skipped
    CPU    exact reference: SDPA per slot, with that slot's boolean mask (L x L) where it has
           an image block or is longer than the window, else ``is_causal``

Example: slots [0 5 14], blocks [[8 12]], window 3: on a sliding layer token 9 attends 7..11
(7, 8, 9 causally inside the window, 10 and 11 later in its block), on a full layer 5..11;
token 13 attends 11, 12, 13 (sliding) or 5..13 (full).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.nn import functional as F

#: keyword argument of the model call that carries a row's `ImageBlockRule` to the attention function
IMAGE_BLOCKS_KWARG = "packed_image_blocks"
#: model types whose image blocks hold on sliding-window layers only, and only where the text config
#: says ``use_bidirectional_attention: "vision"`` (Gemma 4's ``create_masks_for_vision_model``: full
#: layers causal; without the setting every layer is causal)
SLIDING_ONLY_BLOCKS = frozenset({"gemma4"})


def image_block_layers(config: Any) -> str:
    """Which attention layers apply a row's image blocks: "all" (Gemma 3), "sliding" or "none" (Gemma 4)."""
    if getattr(config, "model_type", None) not in SLIDING_ONLY_BLOCKS:
        return "all"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "sliding" if getattr(text, "use_bidirectional_attention", None) == "vision" else "none"


def allowed(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """The packed Gemma 3 rule on (broadcastable) row indices: may ``q`` attend to ``kv``?

    Args:
        q: Query row indices.
        kv: Key row indices.
        slots: int [T] slot (sample) index of every token.
        blocks: int [T] image-block index of every token, -1 on text.
        window: The layer's ``sliding_window`` (None on full-attention layers).
    """
    same_block = (blocks[q] == blocks[kv]) & (blocks[q] >= 0)
    keep = (slots[q] == slots[kv]) & ((kv <= q) | same_block)
    if window is not None:
        keep = keep & (kv > q - window)
    return keep


def token_ids(cu_seqlens_padded: torch.Tensor, spans: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token slot ids and block ids (-1 on text) [T], on the device of ``spans``."""
    device = spans.device
    cu = cu_seqlens_padded.to(device=device, dtype=torch.int64)
    positions = torch.arange(total, device=device)
    slots = torch.bucketize(positions, cu[1:], right=True)
    blocks = torch.full((total,), -1, dtype=torch.int64, device=device)
    for index, (start, end) in enumerate(spans.to("cpu", torch.int64).tolist()):
        blocks[start:end] = index
    return slots, blocks


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # unfused (T x T) without compile


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ImageBlockRule:
    """One packed row's slots and image blocks: the attention rule every layer of one forward applies.

    Built once per micro-batch (`train.forward.packed_inputs`) and handed to every attention
    call through ``IMAGE_BLOCKS_KWARG``; the flex BlockMask of each window is built on first
    use and kept for the other layers and the backward pass.
    """

    segments: tuple[tuple[int, int], ...]  # slot [start, end) per sample
    spans: tuple[tuple[int, int], ...]  # image block [start, end), row order
    slots: torch.Tensor  # int64 [T]
    blocks: torch.Tensor  # int64 [T], -1 on text
    compile: bool = True  # compile create_block_mask / flex_attention (off only to test them on CPU)
    layers: str = "all"  # where the blocks hold: "all", "sliding" (window layers only) or "none"
    _block_masks: dict[tuple[int | None, str], Any] = field(default_factory=dict)
    _plain: list[ImageBlockRule] = field(default_factory=list)  # the rule without blocks, built once

    @classmethod
    def build(
        cls,
        cu_seqlens_padded: torch.Tensor,
        spans: torch.Tensor,
        total: int,
        *,
        compile: bool = True,
        layers: str = "all",
    ) -> ImageBlockRule:
        """From the batch's slot offsets and ``image_blocks`` (row offsets) for a row of ``total`` tokens."""
        bounds = [int(x) for x in cu_seqlens_padded.tolist()]
        pairs = [(int(a), int(b)) for a, b in spans.to("cpu").tolist()]
        slots, blocks = token_ids(cu_seqlens_padded, spans, total)
        return cls(
            segments=tuple(zip(bounds[:-1], bounds[1:])),
            spans=tuple(pairs),
            slots=slots,
            blocks=blocks,
            compile=compile,
            layers=layers,
        )

    def for_layer(self, window: int | None) -> ImageBlockRule:
        """The rule a layer applies: this one, or the same slots without blocks where ``layers`` leaves it causal."""
        if self.layers == "all" or (self.layers == "sliding" and window is not None) or not self.spans:
            return self
        if not self._plain:
            self._plain.append(
                ImageBlockRule(
                    segments=self.segments,
                    spans=(),
                    slots=self.slots,
                    blocks=torch.full_like(self.blocks, -1),
                    compile=self.compile,
                )
            )
        return self._plain[0]

    def dense(self, start: int, end: int, window: int | None) -> torch.Tensor:
        """bool [L, L] mask of the tokens ``[start, end)`` (one slot: the CPU reference's mask)."""
        index = torch.arange(start, end, device=self.slots.device)
        return allowed(index[:, None], index[None, :], self.slots, self.blocks, window)

    def mask_mod(self, window: int | None) -> Callable[..., torch.Tensor]:
        """flex_attention ``mask_mod`` of the rule (batch and head ignored: one row, all heads)."""
        slots, blocks = self.slots, self.blocks

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return allowed(q, kv, slots, blocks, window)

        return mask_mod

    def block_mask(self, window: int | None, device: torch.device) -> Any:
        """The flex BlockMask for ``window`` on ``device``, built once per rule."""
        from torch.nn.attention.flex_attention import create_block_mask

        key = (window, str(device))
        if key not in self._block_masks:
            total = int(self.slots.numel())
            rule = self if self.slots.device == device else self.to(device)
            self._block_masks[key] = create_block_mask(
                rule.mask_mod(window), None, None, total, total, device=device, _compile=self.compile
            )
        return self._block_masks[key]

    def to(self, device: torch.device | str) -> ImageBlockRule:
        """A copy with the per-token ids on ``device`` (no BlockMask carried over)."""
        return ImageBlockRule(
            segments=self.segments,
            spans=self.spans,
            slots=self.slots.to(device),
            blocks=self.blocks.to(device),
            compile=self.compile,
            layers=self.layers,
        )

    def needs_mask(self, start: int, end: int, window: int | None) -> bool:
        """Whether the slot differs from plain causal: it holds a block, or is longer than the window."""
        has_block = any(start <= a < end for a, _ in self.spans)
        return has_block or (window is not None and end - start > window)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rule: ImageBlockRule,
    *,
    window: int | None,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Exact reference: one SDPA per slot with its boolean mask; [1, H, T, D] -> [1, H, T, D]."""
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for a, b in rule.segments:
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        if rule.needs_mask(a, b, window):
            mask = rule.dense(a, b, window).to(query.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        outputs.append(out)
    return torch.cat(outputs, dim=2)


def flex_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rule: ImageBlockRule,
    *,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """flex_attention over the whole row with the rule's BlockMask; [1, H, T, D] -> [1, H, T, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    kernel: Callable[..., Any] = _compiled_flex() if rule.compile else cast(Callable[..., Any], flex_attention)
    block_mask = rule.block_mask(window, query.device)
    out: torch.Tensor = kernel(
        query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out


def flex_available() -> bool:
    """Whether this torch has flex_attention (2.5+)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True
