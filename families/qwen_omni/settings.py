"""What both Qwen-Omni faces read from the processor, derived once (`families.settings.GridSettings`).

The Qwen2-VL image rule with the Omni placeholders; video is not counted (``video`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from families.settings import GridSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class QwenOmniSettings(GridSettings):
    """The processor's settings both faces use (`QwenOmniCounter`, `QwenOmniLayout`)."""

    tokens: ClassVar[tuple[str, str]] = ("<|IMAGE|>", "<|VIDEO|>")
