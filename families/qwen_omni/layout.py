"""Qwen2.5-Omni / Qwen3-Omni thinkers (``Qwen2_5OmniProcessor``, ``Qwen3OmniMoeProcessor``): images.

The patch-grid layout of `families.qwen2_vl.layout` with the Omni placeholders ``<|IMAGE|>`` /
``<|VIDEO|>``. The thinker's ``get_rope_index`` has its own signature (no
``mm_token_type_ids``, ``second_per_grids``); `train.rope` binds arguments by the installed
signature, so nothing here names them. `prep tokenize` counts Omni images only (no audio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.qwen2_vl.layout import GridLayout
from families.qwen_omni.settings import QwenOmniSettings
from families.settings import GridSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class QwenOmniLayout(GridLayout):
    """Qwen-Omni thinker images."""

    settings_class: ClassVar[type[GridSettings]] = QwenOmniSettings
