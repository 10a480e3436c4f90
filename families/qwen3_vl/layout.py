"""Qwen3-VL and Qwen3.5 (``Qwen3VLProcessor``): the patch-grid layout of `families.qwen2_vl.layout`.

Videos carry no ``second_per_grid_ts`` (timestamps are text in the prompt); the vision tower
is 16-pixel patches merged 2x2, all read from the loaded processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.qwen2_vl.layout import GridLayout
from families.qwen3_vl.settings import Qwen3VLSettings
from families.settings import GridSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3VLLayout(GridLayout):
    """Qwen3-VL / Qwen3.5 images and videos."""

    settings_class: ClassVar[type[GridSettings]] = Qwen3VLSettings
