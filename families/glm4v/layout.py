"""GLM-4.1V / 4.5V (``Glm4vProcessor``) and GLM-4.6V / GLM-OCR (``Glm46VProcessor``).

The patch-grid layout of `families.qwen2_vl.layout` with GLM's placeholders ``<|image|>`` /
``<|video|>``; per-frame timestamps are text in the prompt, so videos carry no extra tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.glm4v.settings import Glm4vSettings
from families.qwen2_vl.layout import GridLayout
from families.settings import GridSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class Glm4vLayout(GridLayout):
    """GLM-4.xV images and videos."""

    settings_class: ClassVar[type[GridSettings]] = Glm4vSettings
