"""8-bit pixels from the loader workers, the processor's float inputs made on the device.

Every image processor we train with takes an image through a resize that stays 8-bit (PIL in,
PIL out), then a per-channel ``rescale`` and ``normalize``, then a pure re-arrangement
(patchify, tiles, padding). The middle step maps each of the 256 values of a channel to one
float, so a worker can run the processor with it switched off (`RAW_PIXELS`) and ship the
8-bit result: a quarter of the float32 bytes through the workers' shared memory, and no float
pass over every pixel on a loader core. The step then looks every value up in a ``[C, 256]``
table the processor's **own** ``rescale`` / ``normalize`` made from a ramp of all 256 values
(`normalization_table`): the result is bit-equal to the processor's float32 output, not
merely close (`tests/train/test_pixels.py` checks it for every family).

Where the channel sits: a layout that declares `families.layout.PatchRows` (``pixel_rows``)
ships patch rows ``[..., N, p * p * C]`` in the declared channel order (channel last: Gemma 4,
LFM2-VL), with ``real_rows`` bool ``[..., N]`` from the declared padding keyword; otherwise a
2-D keyword holds flattened patches ``[P, C * k]``, channel-major within a row (Qwen-VL / GLM /
Omni), and any other keyword is image-shaped ``[..., C, H, W]``.
Image-shaped pixels carry ``extents`` ``[..., 2]``: the real ``(h, w)`` of every ``[C, H, W]``
frame. Whatever lies outside is padding that the processor (Idefics3's global tile) or a
``pad_cat`` join (Pixtral sizes, LLaVA tile counts) added after normalising, i.e. 0.0 in the
float tensor; the lookup would make it ``-mean / std``, so it is zeroed again. Example, one
Pixtral image of 32 x 48 px joined with one of 64 x 64::

    values  uint8 [2, 3, 64, 64]    extents [[32, 48], [64, 64]]
    normalized() -> float32 [2, 3, 64, 64], image 0 zero outside rows 0..31 x cols 0..47

Padding rows of patch rows are zeroed the same way. Example, one Gemma 4 image (budget 280)
resized to 576 x 1008 px, 36 x 63 = 2268 patches of 16 x 16 x 3::

    values  uint8 [1, 2520, 768]    real_rows bool [1, 2520], True on rows 0..2267
    normalized() -> float32 [1, 2520, 768], value j of a row looked up in channel j % 3, rows 2268.. 0.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from families.layout import RAW_PIXELS, PatchRows
from packvlm.errors import UsageError

#: the vision keywords that hold pixels (what `PackedPixels` may stand for)
PIXEL_KEYWORDS = ("pixel_values",)
#: the transformers keyword whose zeros mark padding an image processor added (Idefics3 / SmolVLM)
PADDING_MASK = "pixel_attention_mask"


class RawPixelsError(UsageError, ValueError):
    """This image processor's pixels cannot ship as 8-bit values and a table: train with ``--pixels float32``."""


def normalization_table(image_processor: Any, overrides: Mapping[str, Any] | None = None) -> torch.Tensor:
    """float32 ``[C, 256]``: what ``image_processor`` makes of each 8-bit value of each channel.

    Runs the processor's own per-value step on a ramp of 0..255 per channel, with its settings
    (``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean``, ``image_std``), where
    ``overrides`` (a processor's ``images_kwargs``) take precedence as in a processor call.
    """
    names = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
    settings = {k: getattr(image_processor, k, None) for k in names}
    settings |= {k: v for k, v in (overrides or {}).items() if k in settings and v is not None}
    mean = settings["image_mean"]
    channels = len(mean) if isinstance(mean, (list, tuple)) else 3
    ramp = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)))
    if hasattr(image_processor, "rescale_and_normalize"):  # torchvision backend: fused, on tensors
        out = image_processor.rescale_and_normalize(
            torch.from_numpy(ramp)[None],
            bool(settings["do_rescale"]),
            settings["rescale_factor"],
            bool(settings["do_normalize"]),
            settings["image_mean"],
            settings["image_std"],
        )[0]
    else:  # PIL backend: numpy, channels first
        values: np.ndarray = ramp
        if settings["do_rescale"]:
            values = image_processor.rescale(values, settings["rescale_factor"])
        if settings["do_normalize"]:
            values = image_processor.normalize(values, settings["image_mean"], settings["image_std"])
        out = torch.from_numpy(np.asarray(values))
    return out.to(torch.float32).reshape(channels, 256).contiguous()


def as_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` (any dtype) as uint8, exactly: raises `RawPixelsError` if a value is not an 8-bit integer."""
    if pixels.dtype == torch.uint8:
        return pixels
    cast = pixels.to(torch.uint8)
    if not torch.equal(cast.to(pixels.dtype), pixels):
        raise RawPixelsError(
            f"the image processor's {pixels.dtype} output with {dict(RAW_PIXELS)} holds values that are not 8-bit "
            f"integers (range {float(pixels.min())}..{float(pixels.max())}): its resize is not 8-bit; "
            "train with --pixels float32"
        )
    return cast


def frame_extents(pixels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """int32 ``[..., 2]``: the real ``(h, w)`` of every ``[C, H, W]`` frame; None for flattened patches.

    Without ``mask`` every frame is whole. With the processor's padding ``mask`` ``[..., H, W]``
    (1 = real pixel), the real part must be a top-left rectangle (how transformers pads).
    """
    if pixels.dim() < 3:
        return None
    lead, (height, width) = pixels.shape[:-3], pixels.shape[-2:]
    if mask is None:
        return torch.tensor([height, width], dtype=torch.int32).expand(*lead, 2).contiguous()
    real = mask.to(torch.bool)
    rows, cols = real.any(dim=-1).sum(dim=-1), real.any(dim=-2).sum(dim=-1)
    extents = torch.stack([rows, cols], dim=-1).to(torch.int32)
    if not torch.equal(_inside(extents, height, width), real):
        raise RawPixelsError(f"{PADDING_MASK} is not a top-left rectangle per frame: cannot ship 8-bit pixels")
    return extents


def real_patch_rows(pixels: torch.Tensor, rows: PatchRows, padding: torch.Tensor) -> torch.Tensor:
    """bool ``[..., N]``: True on the real patch rows of ``pixels`` ``[..., N, p * p * C]``.

    A row is padding where every entry of ``padding``'s row (``[..., N]`` or ``[..., N, k]``)
    equals ``rows.padding_value``; `RawPixelsError` if the shapes do not fit the declaration.
    """
    real = padding != rows.padding_value
    while real.dim() > pixels.dim() - 1:
        real = real.any(dim=-1)
    if real.shape != pixels.shape[:-1]:
        raise RawPixelsError(
            f"{rows.padding_keyword} {tuple(padding.shape)} does not mark the rows of pixels {tuple(pixels.shape)}: "
            "the layout's pixel_rows declaration does not fit its processor"
        )
    return real


def _inside(extents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """bool ``[..., H, W]``: True inside each frame's ``(h, w)``."""
    device = extents.device
    rows = torch.arange(height, device=device)[:, None] < extents[..., 0, None, None]
    cols = torch.arange(width, device=device) < extents[..., 1, None, None]
    return rows & cols


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedPixels:
    """One pixel keyword as the loader ships it: 8-bit values plus how to make the model's floats."""

    values: torch.Tensor  # uint8, the keyword's layout: [..., N, p * p * C] (rows), [P, C * k] or [..., C, H, W]
    table: torch.Tensor  # float32 [C, 256] (`normalization_table`)
    extents: torch.Tensor | None  # int32 [..., 2] per [C, H, W] frame; None for patch rows
    rows: PatchRows | None = None  # the layout's declared patch rows; None: inferred from the shape
    real_rows: torch.Tensor | None = None  # bool [..., N] with ``rows``: False on padding rows

    @classmethod
    def of(cls, pixels: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None = None) -> PackedPixels:
        """An image processor's output with `RAW_PIXELS` (and its padding ``mask``, if it returns one)."""
        return cls(values=as_uint8(pixels), table=table, extents=frame_extents(pixels, mask))

    @classmethod
    def of_rows(cls, pixels: torch.Tensor, table: torch.Tensor, rows: PatchRows, padding: torch.Tensor) -> PackedPixels:
        """Patch rows ``[..., N, p * p * C]`` as ``rows`` declares them, ``padding`` the keyword marking padding."""
        width = rows.patch_size**2 * int(table.shape[0])
        if pixels.dim() < 2 or pixels.shape[-1] != width:
            raise RawPixelsError(
                f"pixels {tuple(pixels.shape)} are not rows of {rows.patch_size} x {rows.patch_size} x "
                f"{int(table.shape[0])} values: the layout's pixel_rows declaration does not fit its processor"
            )
        real = real_patch_rows(pixels, rows, padding)
        return cls(values=as_uint8(pixels), table=table, extents=None, rows=rows, real_rows=real)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (values, extents, real rows; the table is a few KB)."""
        extras = (t.nbytes for t in (self.extents, self.real_rows) if t is not None)
        return self.values.nbytes + sum(extras)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedPixels:
        """A copy on ``device`` (like ``Tensor.to``)."""
        extents = None if self.extents is None else self.extents.to(device, non_blocking=non_blocking)
        real = None if self.real_rows is None else self.real_rows.to(device, non_blocking=non_blocking)
        return PackedPixels(
            values=self.values.to(device, non_blocking=non_blocking),
            table=self.table.to(device, non_blocking=non_blocking),
            extents=extents,
            rows=self.rows,
            real_rows=real,
        )

    def pin_memory(self) -> PackedPixels:
        """Pinned host copies (torch's DataLoader calls this on custom types when ``pin_memory`` is on)."""
        extents = None if self.extents is None else self.extents.pin_memory()
        real = None if self.real_rows is None else self.real_rows.pin_memory()
        return PackedPixels(
            values=self.values.pin_memory(),
            table=self.table.pin_memory(),
            extents=extents,
            rows=self.rows,
            real_rows=real,
        )

    def normalized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The processor's float tensor, bit-equal in float32, on the values' device."""
        values, channels = self.values, int(self.table.shape[0])
        channel_dim = 1
        if self.rows is not None and self.rows.channel_order == "last":  # [..., N, p * p * C]
            rows = values.reshape(-1, values.shape[-1] // channels, channels)
            channel_dim = 2
        elif self.rows is not None or values.dim() == 2:  # [..., P, C * k], channel-major within a row
            rows = values.reshape(-1, channels, values.shape[-1] // channels)
        else:  # [..., C, H, W]
            rows = values.reshape(-1, channels, values.shape[-2] * values.shape[-1])
        out = torch.empty(rows.shape, dtype=torch.float32, device=values.device)
        table = self.table.to(values.device)
        for channel in range(channels):
            out.select(channel_dim, channel).copy_(table[channel][rows.select(channel_dim, channel).long()])
        out = out.reshape(values.shape)
        if self.real_rows is not None:  # padding rows: 0.0, as the processor padded after normalising
            out = out.masked_fill_(~self.real_rows.to(values.device).unsqueeze(-1), 0.0)
        if self.extents is not None:
            inside = _inside(self.extents.to(values.device), values.shape[-2], values.shape[-1])
            out = out.masked_fill_(~inside.unsqueeze(-3), 0.0)
        return out.to(dtype)


def vision_inputs(vision: Mapping[str, torch.Tensor | PackedPixels]) -> dict[str, torch.Tensor]:
    """The model's vision keywords: `PackedPixels` normalised where they are (call after ``.to(device)``)."""
    return {k: v.normalized() if isinstance(v, PackedPixels) else v for k, v in vision.items()}
