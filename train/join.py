"""How the vision keywords of items, samples and packs join, by the rule their layout declares.

A family's layout (`families.layout.FamilyLayout.joins`) names one `families.layout.Join` rule
per keyword; this applies it to tensors and to 8-bit pixels (`train.pixels.PackedPixels`) alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn import functional as F

from families.layout import Join
from train.pixels import PackedPixels, frame_extents

#: a vision keyword's value: a tensor, or 8-bit pixels the step normalises (`train.pixels`)
VisionValue = torch.Tensor | PackedPixels


def join(rule: Join, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join ``parts`` (token order) by ``rule``; pure."""
    if rule == "cat":
        return torch.cat(list(parts))
    if rule == "cat_dim1":
        return torch.cat(list(parts), dim=1)
    if rule == "cat_last":
        return torch.cat(list(parts), dim=-1)
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
    table, rows = parts[0].table, parts[0].rows
    if any(p.table is not table and not torch.equal(p.table, table) for p in parts[1:]):
        raise ValueError("cannot join pixels normalised by different processors")
    if any(p.rows != rows for p in parts[1:]):
        raise ValueError("cannot join pixels of different patch-row layouts")
    extents = [p.extents for p in parts]
    values = join(rule, [p.values for p in parts])
    if rows is not None:  # patch rows: the real-row marks join like the rows (rows a join adds: padding)
        if rule == "cat_last":
            raise ValueError("patch rows cannot join along their last dim (cat_last)")
        marks = [p.real_rows for p in parts if p.real_rows is not None]
        if len(marks) != len(parts):
            raise ValueError("patch rows without their real-row marks cannot join")
        real = join(rule, marks)
        return PackedPixels(values=values, table=table, extents=None, rows=rows, real_rows=real)
    if rule == "cat_last":  # one frame grows along its width; nothing is padded
        return PackedPixels(values=values, table=table, extents=frame_extents(values))
    return PackedPixels(
        values=values,
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
