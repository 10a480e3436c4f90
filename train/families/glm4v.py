"""GLM-4.1V / 4.5V (``Glm4vProcessor``) and GLM-4.6V / GLM-OCR (``Glm46VProcessor``).

The patch-grid layout of `train.families.qwen2_vl` with GLM's placeholders ``<|image|>`` /
``<|video|>``; per-frame timestamps are text in the prompt, so videos carry no extra tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from train.families.base import register_layout
from train.families.qwen2_vl import GridLayout


@register_layout("Glm4vProcessor", "Glm46VProcessor")
@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vLayout(GridLayout):
    """GLM-4.xV images and videos."""

    tokens: ClassVar[tuple[str, str]] = ("<|image|>", "<|video|>")
