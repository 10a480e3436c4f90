"""Packed (THD / varlen) attention for Hugging Face models: pick it, register it, keep vision safe.

A packed micro-batch is one row of ``T`` tokens; sample ``i`` owns ``[cu[i], cu[i+1])`` and must
attend causally inside its slot only (on sliding-window layers, to the last ``sliding_window``
tokens of its slot: ``kv > q - sliding_window``, transformers' ``sliding_window_overlay``).
``train.forward.packed_forward`` passes the boundaries
explicitly (``cu_seq_lens_q/k``, ``max_length_q/k``) with ``attention_mask=None``, so nothing
depends on transformers guessing them from ``position_ids``. Which kernel consumes them:

    CUDA + flash-attn importable   "flash_attention_2"  (transformers' own varlen path)
    otherwise                      "packvlm_varlen"     (registered here):
        CUDA, fp16/bf16            torch.nn.attention.varlen.varlen_attn, causal = window (-1, 0),
                                   sliding = (sliding_window - 1, 0) as transformers' flash path
                                   (``is_causal`` / repeated kv heads on torch builds whose kernel
                                   lacks ``window_size`` / ``enable_gqa``)
        CUDA, no varlen kernel     flex_attention with a document mask (`train.block_attention`'s
        (torch < 2.13 builds)      rule without image blocks: same slot AND causal [AND window]),
                                   one BlockMask per micro-batch built by `train.forward`: no
                                   Python loop over samples, fully masked tiles skipped
        CPU, fp32, dropout > 0     exact reference: SDPA per sample over the cu_seqlens slices
                                   (a slot longer than the window gets its L x L window mask;
                                   one warning on CUDA: autocast to bf16 to get the kernel)
    with image blocks              Gemma 3's rule (`train.block_attention`): flex_attention with a
    (``packed_image_blocks``)      BlockMask per micro-batch on CUDA, per-slot masked SDPA on CPU

None builds an O(T^2) mask over the row: the mask function registered with ``AttentionMaskInterface``
returns ``None`` unless the caller passes a padding mask (a padded, unpacked batch, which
then gets transformers' SDPA mask and SDPA).

Vision towers. The Qwen-VL models hand the *text* model's ``**kwargs`` to the vision tower
(``get_image_features(..., **kwargs)`` -> ``self.visual(...)`` -> ``VisionAttention``). There the
text boundaries are wrong twice over: on the flash path ``VisionAttention`` passes its own
``cu_seq_lens_q=cu_seqlens`` next to ``**kwargs`` (a duplicate keyword), on the other paths it
calls attention per image with ``**kwargs`` that would carry the text ``cu_seq_lens``.
transformers 5.23 drops those four keys in ``accepts_precomputed_kwargs``; we do not rely on
it. :func:`prepare_model_for_packing` adds a forward pre-hook to every vision tower that drops
them, whatever the transformers version or attention implementation, and the attention
function refuses boundaries that do not cover its input (a loud error, never a silent mix).
A hook was chosen over giving the vision sub-config its own attention implementation because
it also protects ``flash_attention_2`` (which must stay on for vision speed) and needs no
knowledge of each family's sub-config layout. With "packvlm_varlen" the vision tower takes
transformers' per-image path (the name has no "flash"), so each image attends to itself only.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from packvlm.errors import InternalError
from train.block_attention import (
    IMAGE_BLOCKS_KWARG,
    ImageBlockRule,
    flex_attention_forward,
    flex_available,
    reference_attention,
)
from train.linear_attention import install_packed_linear_attention

log = logging.getLogger(__name__)
ModuleT = TypeVar("ModuleT", bound=nn.Module)

PACKED_ATTENTION = "packvlm_varlen"
FLASH_ATTENTION = "flash_attention_2"
#: the keyword arguments that carry the text model's varlen boundaries
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: every keyword that describes the text row's packing (dropped before vision towers)
PACKED_KWARGS = (*VARLEN_KWARGS, IMAGE_BLOCKS_KWARG)
_HOOK_FLAG = "_packvlm_vision_hook"


class PackedAttentionError(InternalError, ValueError):
    """Varlen boundaries that do not describe the input (wrong length, unsorted, q != k)."""


def select_attention(device: torch.device | str) -> str:
    """The attention implementation for packed input on ``device``.

    ``flash_attention_2`` on CUDA when the ``flash_attn`` package is importable, else
    ``packvlm_varlen`` (torch's varlen kernel on CUDA, the exact per-sample SDPA on CPU).
    """
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return FLASH_ATTENTION
    return PACKED_ATTENTION


def needs_document_mask(device: torch.device | str, implementation: str | None) -> bool:
    """Whether packed rows on ``device`` go through flex_attention with a document mask.

    True on CUDA for "packvlm_varlen" when torch has no varlen kernel (CUDA builds before
    2.13) and flex_attention exists: a per-sample SDPA loop there would launch a kernel per
    sample per layer. `train.forward.packed_inputs` then builds the mask once per micro-batch.
    """
    return (
        torch.device(device).type == "cuda"
        and implementation == PACKED_ATTENTION
        and _varlen_kernel() is None
        and flex_available()
    )


def _segments(cu: torch.Tensor, total: int, name: str) -> list[tuple[int, int]]:
    bounds = [int(x) for x in cu.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(x > y for x, y in zip(bounds, bounds[1:])):
        raise PackedAttentionError(
            f"{name} {bounds[:8]}{'...' if len(bounds) > 8 else ''} does not split {total} tokens into ordered "
            "slots; pass the batch's cu_seqlens_padded (slot offsets) for this row"
        )
    return list(zip(bounds[:-1], bounds[1:]))


def _boundaries_from_positions(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Slot starts where text positions restart at their minimum (transformers' flash rule)."""
    if position_ids is None or batch != 1 or position_ids.dim() != 2:
        return None
    row = position_ids.reshape(-1)
    starts = (row == row.min()).nonzero().view(-1)
    if starts.numel() < 2:
        return None
    return torch.cat([starts, starts.new_tensor([row.numel()])]).to(torch.int32)


def _per_sample_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int]],
    *,
    causal: bool,
    scaling: float | None,
    dropout: float,
    window: int | None = None,
) -> torch.Tensor:
    """Exact reference: one SDPA per slot on [1, H, L, D] slices; returns [1, H, T, D].

    A causal slot longer than ``window`` gets transformers' sliding mask (kv <= q, kv > q - window).
    """
    outputs = []
    for a, b in segments:
        mask, is_causal = None, causal
        if window is not None and b - a > window:
            index = torch.arange(b - a, device=query.device)
            mask, is_causal = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - window), False
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=is_causal,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
    return torch.cat(outputs, dim=2)


def _kernel_dtype(query: torch.Tensor) -> torch.dtype | None:
    """fp16/bf16 for the CUDA kernel: the tensors' own, else the autocast dtype, else None.

    Under bf16 autocast with fp32 weights the Qwen-VL rotary embedding (fp32 cos/sin) hands q/k
    over in fp32 and v in bf16; like transformers' flash path we cast to the autocast dtype.
    """
    half = (torch.float16, torch.bfloat16)
    if not query.is_cuda:
        return None
    if query.dtype in half:
        return query.dtype
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in half:
        return torch.get_autocast_dtype("cuda")
    return None


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's varlen kernel and its keyword names (they changed across 2.x), or None if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _cuda_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_length: int,
    *,
    causal: bool,
    scaling: float | None,
    window: int | None = None,
) -> torch.Tensor | None:
    """torch's flash varlen kernel on (total, heads, dim) views: [1, H, T, D], or None if absent.

    ``window`` (causal only): flash's ``window_size=(window - 1, 0)``, i.e. ``kv >= q - window + 1``,
    transformers' ``kv > q - sliding_window`` (its flash path passes ``sliding_window - 1`` too).
    """
    kernel = _varlen_kernel()
    if kernel is None or (window is not None and "window_size" not in kernel[1]):
        return None
    varlen_attn, params = kernel
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    options: dict[str, Any] = {"scale": scaling}
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0)
        options["window_size"] = ((-1 if window is None else window - 1), 0) if causal else (-1, -1)
    else:
        options["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu, cu, int(max_length), int(max_length), **options)
    return out.transpose(0, 1).unsqueeze(0)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for packed rows; q/k/v ``[B, H, S, D]`` -> ``[B, S, H, D]``.

    Boundaries: ``cu_seq_lens_q/k`` when given, else the restarts of ``position_ids`` (as
    transformers' flash path), else none: each row is one sequence and transformers' SDPA runs.
    Causality: ``is_causal`` when the caller says (vision towers pass False), else the module's.
    """
    cu = cu_seq_lens_q if cu_seq_lens_q is not None else _boundaries_from_positions(position_ids, query.shape[0])
    rule: ImageBlockRule | None = kwargs.pop(IMAGE_BLOCKS_KWARG, None)
    rule = None if rule is None else rule.for_layer(sliding_window)  # Gemma 4: blocks on sliding layers only
    if attention_mask is not None or cu is None:
        # Unpacked: a padded batch with transformers' mask, one sequence per row, a vision
        # tower's per-image call, or cached decoding. transformers' SDPA handles all of them.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window is not None and not causal:
        raise NotImplementedError("packvlm_varlen has no bidirectional sliding-window attention")
    dropout = dropout if module.training else 0.0
    total = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != total:
        raise PackedAttentionError(f"packed attention needs batch 1 and equal q/k lengths, got {tuple(query.shape)}")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu and not torch.equal(cu_seq_lens_k.cpu(), cu.cpu()):
        raise PackedAttentionError("cu_seq_lens_k differs from cu_seq_lens_q; packed self-attention needs one layout")
    if rule is not None and _applies_rule(rule, causal, query):
        return _image_block_attention(query, key, value, rule, causal, sliding_window, scaling, dropout), None
    kernel_dtype = _kernel_dtype(query)
    out = None
    if kernel_dtype is not None and dropout == 0.0 and max_length_q is not None:  # cu checked by packed_forward
        q, k, v = (t.to(kernel_dtype) for t in (query, key, value))
        out = _cuda_varlen(q, k, v, cu, int(max_length_q), causal=causal, scaling=scaling, window=sliding_window)
    if out is None:
        if query.is_cuda:
            _warn_slow_path(query.dtype, dropout)
        segments = _segments(cu, total, "cu_seq_lens_q")
        out = _per_sample_sdpa(
            query, key, value, segments, causal=causal, scaling=scaling, dropout=dropout, window=sliding_window
        )
    return out.transpose(1, 2).contiguous(), None


def _applies_rule(rule: ImageBlockRule, causal: bool, query: torch.Tensor) -> bool:
    """Image blocks (Gemma 3) always; a plain document mask only on causal CUDA rows (flex), else
    the per-sample reference below serves it."""
    return bool(rule.spans) or (causal and query.is_cuda)


def _image_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rule: ImageBlockRule,
    causal: bool,
    window: int | None,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Gemma 3's packed rule (`train.block_attention`): flex on CUDA, per-slot masked SDPA otherwise."""
    if not causal:
        raise NotImplementedError("image blocks on a bidirectional layer: no packed rule for it")
    if rule.segments[-1][1] != query.shape[2]:
        raise PackedAttentionError(
            f"image-block rule covers {rule.segments[-1][1]} tokens, the row has {query.shape[2]}"
        )
    if query.is_cuda and dropout == 0.0 and flex_available():
        dtype = _kernel_dtype(query) or query.dtype
        q, k, v = (t.to(dtype) for t in (query, key, value))
        out = flex_attention_forward(q, k, v, rule, window=window, scaling=scaling)
    else:
        if query.is_cuda:
            _warn_slow_path(query.dtype, dropout)
        out = reference_attention(query, key, value, rule, window=window, scaling=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous()


def packed_attention_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for packed rows (the boundaries travel as cu_seqlens); SDPA's mask for padding."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


@functools.cache
def _warn_slow_path(dtype: torch.dtype, dropout: float) -> None:
    log.warning(
        "packvlm_varlen: per-sample SDPA on CUDA (dtype %s, dropout %s, varlen kernel %s); "
        "train in bf16 autocast for torch's varlen kernel",
        dtype,
        dropout,
        "available" if _varlen_kernel() else "missing",
    )


def register_packed_attention() -> str:
    """Register ``packvlm_varlen`` with transformers (idempotent); returns the name."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)
    return PACKED_ATTENTION


def _drop_text_varlen_kwargs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, {k: v for k, v in kwargs.items() if k not in PACKED_KWARGS}


def vision_towers(model: nn.Module) -> list[nn.Module]:
    """Sub-models that encode images/videos: built from a ``vision_config`` or declared image-only."""
    towers: list[nn.Module] = []
    for module in model.modules():
        config_key = getattr(getattr(module, "config", None), "base_config_key", None)
        modalities = getattr(type(module), "input_modalities", None) or ("text",)
        is_tower = config_key == "vision_config" or "text" not in modalities
        if module is not model and isinstance(module, PreTrainedModel) and is_tower:
            towers.append(module)
    return towers


def prepare_model_for_packing(model: ModuleT) -> ModuleT:
    """Make ``model`` safe for packed rows (idempotent): vision towers never see text boundaries.

    Hybrid linear-attention models: gated delta nets get per-sample conv and state resets
    (``train.linear_attention``); any other linear layer is refused there
    (``UnsupportedLinearAttentionError``), never trained with samples leaking into each other.
    """
    install_packed_linear_attention(model)
    for tower in vision_towers(model):
        if not getattr(tower, _HOOK_FLAG, False):
            tower.register_forward_pre_hook(_drop_text_varlen_kwargs, with_kwargs=True)
            setattr(tower, _HOOK_FLAG, True)
    return model


register_packed_attention()
