"""Rendered text -> token ids and loss mask, as the processor tokenizes it.

The ids and offsets come from :mod:`prep.tokenize.offsets` (the tokenizers backend where
transformers' call reduces to it), a text with media expansions (their declared runs of one
added token) from :class:`~prep.tokenize.runs.RunEncoder`; the mask is transformers' overlap rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from prep.tokenize.expansion import ExpandedText
from prep.tokenize.offsets import encode_pairs, pairs_mask
from prep.tokenize.runs import RunEncoder
from prep.tokenize.template import RenderedText


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedText:
    input_ids: list[int]
    loss_mask: npt.NDArray[np.uint8]  # same length


def tokenize_rendered(
    tokenizer: Any, rendered: RenderedText | ExpandedText, runs: RunEncoder | None = None
) -> TokenizedText:
    """Tokenize as the processor does (no second BOS when the template already starts with it).

    ``runs``: the worker's :class:`RunEncoder`, which tokenizes a media expansion's runs of one
    added token once (the same ids and mask); without it the text goes to the tokenizer whole.
    """
    bos = tokenizer.bos_token
    if isinstance(rendered, ExpandedText):
        if runs is not None:
            add_special = not (bos is not None and rendered.pieces.startswith(bos))
            input_ids, mask = runs.encode_masked(rendered, add_special)
            return TokenizedText(input_ids=input_ids, loss_mask=mask)
        rendered = rendered.rendered()
    add_special = not (bos is not None and rendered.text.startswith(bos))
    input_ids, pairs = encode_pairs(tokenizer, rendered.text, add_special)
    return TokenizedText(
        input_ids=input_ids, loss_mask=pairs_mask(pairs, rendered.assistant_spans, rendered.media_spans)
    )
