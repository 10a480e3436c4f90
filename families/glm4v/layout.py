"""GLM-4.1V / 4.5V (``Glm4vProcessor``) and GLM-4.6V / GLM-OCR (``Glm46VProcessor``).

The patch-grid layout of `families.qwen2_vl.layout` with GLM's placeholders ``<|image|>`` /
``<|video|>``; per-frame timestamps are text in the prompt, so videos carry no extra tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.qwen2_vl.layout import GridLayout


@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vLayout(GridLayout):
    """GLM-4.xV images and videos."""

    tokens: ClassVar[tuple[str, str]] = ("<|image|>", "<|video|>")
