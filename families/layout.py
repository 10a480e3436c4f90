"""What a model family's training layout provides (train's face of a family).

A layout answers, for one family, how the stored media of a pack become the vision keyword
arguments of the family's model ``forward``: it runs the family's **own** image (and video)
processor on each stored item, reports what the processor made of it (grid, tiles, tokens:
checked against what `prep tokenize` stored), and declares once how each keyword joins
across items, samples and packs (`train.join` joins them). Each family's
``families/<name>/layout.py`` holds one; `families.registry` finds it by processor class.

Example (Pixtral): one sample with two images gives per item ``pixel_values`` [1, 3, H_i, W_i]
and ``image_sizes`` [1, 2]; ``joins`` says ``pixel_values`` is zero-padded to the largest H, W
and stacked (``pad_cat``), ``image_sizes`` concatenated (``cat``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

import numpy as np
import torch
from PIL import Image

from families.processor import ProcessorBundle

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids values (keys of a layout's ``mm_token_ids``)
#: how a vision keyword joins items / samples / packs (in token order):
#: "cat"      torch.cat along dim 0 (same trailing shape)
#: "pad_cat"  zero-pad every trailing dim to the largest, then cat along dim 0
#: "cat_dim1" torch.cat along dim 1 (a leading batch dim of 1, e.g. Idefics3 [1, tiles, C, H, W])
#: "cat_last" torch.cat along the last dim (NaViT-packed patches, e.g. MiniCPM-V [1, C, P, patches * P])
Join = Literal["cat", "pad_cat", "cat_dim1", "cat_last"]
#: image-processor keywords that switch off the per-value step (kept: resize, crops, tiles, padding):
#: a layout's default ``pixel_kwargs``, so its pixels leave the processor 8-bit (`train.pixels`)
RAW_PIXELS: Mapping[str, bool] = MappingProxyType({"do_rescale": False, "do_normalize": False})
#: positions rule: "mrope" (the model's own ``get_rope_index`` per sample) or "text" (restart per sample)
Rope = Literal["mrope", "text"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PatchRows:
    """How a layout's ``pixel_values`` hold flattened patch rows, declared so 8-bit values can ship.

    ``pixel_values`` ``[..., N, patch_size**2 * C]``: each row one patch, the channel the fastest
    axis of a row (``"last"``: SigLIP2 NaFlex, Gemma 4, LFM2-VL) or the slowest (``"major"``).
    Rows after an image's real patches are padding the processor added *after* normalising
    (0.0 in its float output); ``padding_keyword`` marks them: a row is padding where every
    entry of that keyword's row equals ``padding_value``. `train.pixels` reads this declaration.

    Example (Gemma 4, budget 280): ``PatchRows(patch_size=16, channel_order="last",
    padding_keyword="image_position_ids", padding_value=-1)`` for ``pixel_values`` [1, 2520, 768].
    """

    patch_size: int
    channel_order: Literal["last", "major"]
    padding_keyword: str  # the item keyword whose rows mark padding (same leading shape [..., N])
    padding_value: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemInputs:
    """One media item through the family's processor: its tensors and what the plan must match."""

    tensors: dict[str, torch.Tensor]  # model keyword -> this item's part, in the join's layout
    grid_thw: tuple[int, int, int]  # as `prep tokenize` records it for the family
    num_tiles: int  # image arrays the processor made (tiles / crops + global view)
    num_tokens: int  # placeholder tokens the item expands to in the text
    num_patches: int  # patches the vision encoder embeds for it (its share of the vision compute)


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleInputs:
    """One sample's media through the processor: per item, plus per-sample keywords (e.g. counts)."""

    items: tuple[ItemInputs, ...] = ()
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. batch_num_images [1]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodedVideo:
    """Frames in ``frame_indices`` order plus the container fields tokenize read (same source)."""

    frames: np.ndarray  # uint8 [n, H, W, 3]
    total_frames: int
    fps: float

    @property
    def sampled_fps(self) -> float:
        """transformers' ``VideoMetadata.sampled_fps``: frames kept per second of video."""
        return len(self.frames) / self.total_frames * self.fps


class FamilyLayout(Protocol):
    """Per-family vision layout, built once per loader worker from the loaded processor.

    ``joins`` names every keyword the layout can emit; ``rope`` picks the positions rule;
    ``mm_token_ids`` maps transformers' ``mm_token_type_ids`` values (1 image, 2 video) to the
    placeholder token id in the expanded text (the rope index and some models read it).
    Optional: ``pixel_rows`` (`PatchRows`), for a layout whose ``pixel_values`` are patch rows
    with the channel last or with padding rows (without it: 2-D means channel-major rows, any
    other shape ``[..., C, H, W]``).
    """

    @property
    def joins(self) -> Mapping[str, Join]: ...

    @property
    def rope(self) -> Rope: ...

    @property
    def mm_token_ids(self) -> Mapping[int, int]: ...

    @property
    def supports_video(self) -> bool: ...

    @property
    def pixel_kwargs(self) -> Mapping[str, bool]:
        """Keywords of every image-processor call: `RAW_PIXELS` (8-bit out) or empty (floats)."""
        ...

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        """One sample's media (images then videos, each in token order) -> processor outputs."""
        ...


class LayoutClass(Protocol):
    """A layout class: built from the loaded processor."""

    def from_bundle(self, bundle: ProcessorBundle) -> FamilyLayout: ...
