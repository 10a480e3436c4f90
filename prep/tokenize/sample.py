"""One tokenized sample, whichever path produced it (closed-form counter or real processor)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from families.counter import MediaCount


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedSample:
    input_ids: list[int]
    loss_mask: npt.NDArray[np.uint8]
    media: list[tuple[str, MediaCount]]  # (formatted MediaRef, count) in placeholder order

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_media_tokens(self) -> int:
        return sum(count.num_tokens for _, count in self.media)
