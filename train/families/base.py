"""What a model family's training layout provides, and the registry that finds it.

A layout answers, for one family, how the stored media of a pack become the vision keyword
arguments of the family's model ``forward``: it runs the family's **own** image (and video)
processor on each stored item, reports what the processor made of it (grid, tiles, tokens:
checked against what `prep tokenize` stored), and declares once how each keyword joins
across items, samples and packs. Layouts are keyed by processor class name, like the
counters of `prep.tokenize.families`; every module of this package registers itself when the
package is imported.

Example (Pixtral): one sample with two images gives per item ``pixel_values`` [1, 3, H_i, W_i]
and ``image_sizes`` [1, 2]; ``joins`` says ``pixel_values`` is zero-padded to the largest H, W
and stacked (``pad_cat``), ``image_sizes`` concatenated (``cat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F

from train.pixels import PackedPixels

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids values (keys of a layout's ``mm_token_ids``)
#: how a vision keyword joins items / samples / packs (in token order):
#: "cat"      torch.cat along dim 0 (same trailing shape)
#: "pad_cat"  zero-pad every trailing dim to the largest, then cat along dim 0
#: "cat_dim1" torch.cat along dim 1 (a leading batch dim of 1, e.g. Idefics3 [1, tiles, C, H, W])
Join = Literal["cat", "pad_cat", "cat_dim1"]
#: a vision keyword's value: a tensor, or 8-bit pixels the step normalises (`train.pixels`)
VisionValue = torch.Tensor | PackedPixels
#: positions rule: "mrope" (the model's own ``get_rope_index`` per sample) or "text" (restart per sample)
Rope = Literal["mrope", "text"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemInputs:
    """One media item through the family's processor: its tensors and what the plan must match."""

    tensors: dict[str, VisionValue]  # model keyword -> this item's part, in the join's layout
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
        """Keywords of every image-processor call: `train.pixels.RAW_PIXELS` (8-bit out) or empty (floats)."""
        ...

    def sample_inputs(self, images: Sequence[Image.Image], videos: Sequence[DecodedVideo]) -> SampleInputs:
        """One sample's media (images then videos, each in token order) -> processor outputs."""
        ...


class LayoutClass(Protocol):
    """A layout class: built from a `prep.tokenize.processor.ProcessorBundle`."""

    def from_bundle(self, bundle: Any) -> FamilyLayout: ...


L = TypeVar("L", bound=LayoutClass)
_REGISTRY: dict[str, LayoutClass] = {}  # processor class name -> layout class


def register_layout(*processor_classes: str) -> Callable[[L], L]:
    """Class decorator: the layout serves processors of these class names."""

    def wrap(cls: L) -> L:
        for name in processor_classes:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise ValueError(f"a training layout for {name} is registered twice")
            _REGISTRY[name] = cls
        return cls

    return wrap


def registered_layouts() -> dict[str, LayoutClass]:
    """Processor class name -> layout class, every family module imported."""
    import train.families  # noqa: F401  (registers every module)

    return dict(_REGISTRY)


def find_layout(processor_class: str) -> LayoutClass | None:
    """The layout class serving ``processor_class``, or None (the family cannot train)."""
    return registered_layouts().get(processor_class)


def join(rule: Join, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join ``parts`` (token order) by ``rule``; pure."""
    if rule == "cat":
        return torch.cat(list(parts))
    if rule == "cat_dim1":
        return torch.cat(list(parts), dim=1)
    if rule == "pad_cat":
        shape = [max(int(p.shape[d]) for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in reversed(range(1, p.dim())):
                pad += [0, shape[d - 1] - int(p.shape[d])]
            padded.append(F.pad(p, pad) if any(pad) else p)
        return torch.cat(padded)
    raise ValueError(f"unknown join rule {rule!r}")


def join_pixels(rule: Join, parts: Sequence[PackedPixels]) -> PackedPixels:
    """Join 8-bit pixels like their float tensors; frame extents join by the same rule (padded frames: 0 x 0)."""
    table = parts[0].table
    if any(p.table is not table and not torch.equal(p.table, table) for p in parts[1:]):
        raise ValueError("cannot join pixels normalised by different processors")
    extents = [p.extents for p in parts]
    return PackedPixels(
        values=join(rule, [p.values for p in parts]),
        table=table,
        extents=None if any(e is None for e in extents) else join(rule, [e for e in extents if e is not None]),
    )


def join_fields(joins: Mapping[str, Join], parts: Sequence[Mapping[str, VisionValue]]) -> dict[str, VisionValue]:
    """Join each keyword over ``parts`` (items, samples or packs, in token order); absent keywords skipped."""
    out: dict[str, VisionValue] = {}
    for name, rule in joins.items():
        present = [p[name] for p in parts if name in p]
        if not present:
            continue
        pixels = [v for v in present if isinstance(v, PackedPixels)]
        if pixels and len(pixels) != len(present):
            raise TypeError(f"{name}: cannot join 8-bit pixels with float tensors (one --pixels setting per run)")
        tensors = [v for v in present if isinstance(v, torch.Tensor)]
        out[name] = join_pixels(rule, pixels) if pixels else join(rule, tensors)
    return out
