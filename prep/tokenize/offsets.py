"""Token ids, character offsets and the overlap mask of a text, at the tokenizer's own cost.

``tokenizer(text, add_special_tokens=..., return_offsets_mapping=True)`` on a fast tokenizer
(transformers 5.x ``TokenizersBackend``) resolves padding and truncation strategies, checks the
input's type, sets the backend's truncation, padding and ``encode_special_tokens`` to what the
call asks (off, off, ``split_special_tokens``), calls ``encode_batch([text])`` and copies each
field of the one encoding into a ``BatchEncoding``: about a third of the call on a 600-character
sample. Where a class inherits all of that unchanged from ``TokenizersBackend`` (no subclass
override on the way; read in transformers 5.8.0, 5.12.1 and 5.24.0, the same there but for a
``sanitize_control_tokens`` branch this call never takes) and the backend is already in the state
the call would set, the call is exactly ``backend.encode(text, add_special_tokens=...)`` (the
backend's one-text entry, the same pipeline as its batch entry: normalizer, added tokens,
pre-tokenizer, model, post-processor), and :func:`encode_offsets` calls that. Anything else (a
slow or remote-code tokenizer, an override, a backend left truncating) takes the ``__call__``.
The one thing skipped is transformers' "sequence longer than model_max_length" log line.

The mask is transformers' overlap rule (``return_assistant_tokens_mask``), for any offsets: a
token is trained on when its ``[start, end)`` overlaps an assistant span (``start < span_end and
end > span_start``), and never when it overlaps a media span. Where the offsets' starts and ends
never decrease it takes two bisections per span (:func:`pairs_mask`), else one array test per
span; an offsets array, where one is needed, is built by ``np.fromiter`` over the flattened pairs
(less than half of ``np.asarray`` on a list of tuples).

Example (``prep example --family qwen2_vl``'s tokenizer): ``"<|im_start|>assistant\\nHi<|im_end|>"``
with the assistant span ``Hi<|im_end|>`` (characters 22-34) -> offsets ``(0, 12) (12, 21) (21, 22)
(22, 23) (23, 24) (24, 34)``, mask ``[0, 0, 0, 1, 1, 1]``.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from transformers.tokenization_utils_tokenizers import TokenizersBackend

# What ``__call__`` runs on the way to the backend, as TokenizersBackend defines it; a class
# overriding any of them (or adding a target/input mode switch) is not known to reduce to encode().
_PATH = (
    "__call__",
    "_get_padding_truncation_strategies",
    "_encode_plus",
    "set_truncation_and_padding",
    "_convert_encoding",
    "_switch_to_input_mode",
    "_switch_to_target_mode",
)


_REDUCES: dict[type, bool] = {}  # per tokenizer class
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _reduces_to_backend(cls: type) -> bool:
    """``cls.__call__(text)`` is TokenizersBackend's own path, attribute for attribute."""
    if cls not in _REDUCES:
        _REDUCES[cls] = issubclass(cls, TokenizersBackend) and all(
            getattr(cls, name, None) is getattr(TokenizersBackend, name, None) for name in _PATH
        )
    return _REDUCES[cls]


def direct_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``encode`` equals this call of ``tokenizer``, or None.

    Checked per call, as ``__call__`` would reset them: no truncation, no padding, special-token
    splitting as the tokenizer's ``split_special_tokens`` says."""
    if not _reduces_to_backend(type(tokenizer)) or any(name in vars(tokenizer) for name in _PATH):
        return None
    backend = tokenizer._tokenizer
    if (
        backend.truncation is not None
        or backend.padding is not None
        or backend.encode_special_tokens != tokenizer.split_special_tokens
    ):
        return None
    return backend


def encode_pairs(tokenizer: Any, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and ``(start, end)`` character offsets of ``text``, as ``tokenizer(text, return_offsets_mapping=True)``."""
    backend = direct_backend(tokenizer)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets
    call = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(call["input_ids"]), call["offset_mapping"]


def encode_offsets(tokenizer: Any, text: str, add_special_tokens: bool) -> tuple[list[int], npt.NDArray[np.int64]]:
    """:func:`encode_pairs` with the offsets as one (n, 2) array."""
    ids, pairs = encode_pairs(tokenizer, text, add_special_tokens)
    return ids, _as_array(pairs)


def _as_array(pairs: list[tuple[int, int]]) -> npt.NDArray[np.int64]:
    flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
    return flat.reshape(-1, 2)


def pairs_mask(
    pairs: list[tuple[int, int]], spans: list[tuple[int, int]], media_spans: tuple[tuple[int, int], ...]
) -> npt.NDArray[np.uint8]:
    """:func:`overlap_mask` of offsets as the tokenizer gives them, without an array where it can.

    Where starts and ends both never decrease (the usual case), the tokens a span ``[s, e)``
    overlaps are exactly those from the first whose end exceeds ``s`` to the last whose start is
    below ``e``: two bisections per span. Otherwise (out-of-order offsets) every token is tested."""
    if not spans:
        return np.zeros(len(pairs), dtype=np.uint8)
    starts = list(map(_FIRST, pairs))
    ends = list(map(_SECOND, pairs))
    if starts != sorted(starts) or ends != sorted(ends):
        return overlap_mask(_as_array(pairs), spans, media_spans)
    return np.frombuffer(sorted_pairs_mask(starts, ends, spans, media_spans), dtype=np.uint8)


def sorted_pairs_mask(
    starts: list[int], ends: list[int], spans: Sequence[tuple[int, int]], media_spans: Sequence[tuple[int, int]]
) -> bytearray:
    """:func:`pairs_mask` of offsets already split into ``starts`` and ``ends``, both known never to
    decrease (`prep.tokenize.runs` checks that once for its own use), as one byte per token."""
    mask = bytearray(len(starts))
    if not spans:
        return mask
    for start, end in spans:
        lo, hi = bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)
        if hi > lo:
            mask[lo:hi] = b"\x01" * (hi - lo)
    for start, end in media_spans:
        lo, hi = bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)
        if hi > lo:
            mask[lo:hi] = bytes(hi - lo)
    return mask


def overlap_mask(
    offsets: npt.NDArray[np.int64], spans: list[tuple[int, int]], media_spans: tuple[tuple[int, int], ...]
) -> npt.NDArray[np.uint8]:
    """1 where a token overlaps an assistant span and no media span (transformers' overlap rule)."""
    mask = np.zeros(len(offsets), dtype=bool)
    if spans:
        starts, ends = offsets[:, 0], offsets[:, 1]
        for start, end in spans:
            mask |= (starts < end) & (ends > start)
        for start, end in media_spans:
            mask &= (starts >= end) | (ends <= start)
    return mask.view(np.uint8)
