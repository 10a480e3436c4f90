"""Where each bidirectional image block of a packed row sits (Gemma 3), from the stored plan and the row.

A family whose layout declares ``image_attention = "bidirectional"`` attends both ways inside
each image block: one tile's run of ``image_seq_length`` soft tokens. The pack json says, per
media item, which sample it belongs to, how many tiles it has and how many soft tokens it
expands to (``num_tiles``, ``num_tokens``, both checked against the processor by
`train.media`), and the items are stored in token order; it does not store token offsets.
The offsets are read from the sample's own tokens: the k-th maximal run of the soft token id
in the slot is the k-th tile of the sample's items, in order. That is exact because

* the soft token is a special added token that only the counter's expansion emits, each tile
  as ``<start_of_image>`` + ``image_seq_length`` soft tokens + ``<end_of_image>`` spliced as
  text and tokenized whole (`families.gemma3.counter`), so each tile is exactly one
  maximal run and two tiles never touch;
* the runs must match the plan one to one: their count is the sample's total ``num_tiles``
  and each run's length the item's ``num_tokens / num_tiles``, else `PlanMismatchError`
  naming pack, sample and both lists (e.g. a literal soft token typed into a prompt);
* transformers defines the block the same way for one sample
  (``modeling_gemma3.get_block_sequence_ids_for_mask``: maximal runs of
  ``token_type_ids == 1``, and the processor sets ``token_type_ids`` where the id is the soft
  token), so the spans are the model's own blocks.

A family whose layout also declares ``video_attention = "bidirectional"`` (Gemma 4) attends both
ways inside each video *frame*'s run of soft tokens (transformers groups maximal runs of image
or video tokens, and each frame's run is closed by its own delimiters): a video item of
``grid_t`` frames is ``grid_t`` runs of ``num_tokens / grid_t`` video tokens, checked the same way.

Example: a pack of two samples, the second with one image (4 soft tokens per tile here),
no padding: ``cu_seqlens`` [0 5 14], sample 1 ``[t t B s s s s E t]`` -> spans [[8, 12]].
"""

from __future__ import annotations

import numpy as np
import torch

from schemas.packed import LoadedPack
from train.media import PlanMismatchError

#: [0, 2] int32: a row without image blocks
NO_BLOCKS = (0, 2)


def empty_spans() -> torch.Tensor:
    """int32 [0, 2]: no image block."""
    return torch.zeros(NO_BLOCKS, dtype=torch.int32)


def token_runs(ids: np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of ``token_id`` in ``ids``, in order."""
    hit = np.concatenate([[False], np.asarray(ids) == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def planned_block_lengths(pack: LoadedPack, sample: int, kind: str = "image") -> list[int]:
    """Soft tokens per block of ``sample``'s items of ``kind``, in token order, as the plan stores them.

    An image's blocks are its tiles (``num_tiles``), a video's its frames (``grid_t``).
    """
    lengths: list[int] = []
    for item in pack.media:
        meta = item.meta
        if meta.sample != sample or meta.kind != kind:
            continue
        parts = max(int(meta.num_tiles if kind == "image" else meta.grid_thw[0]), 1)
        unit = "tiles" if kind == "image" else "frames"
        if meta.num_tokens % parts:
            raise PlanMismatchError(
                f"pack {pack.key}, sample {pack.sample_ids[sample]}, member {meta.member}: {meta.num_tokens} tokens do "
                f"not split into {parts} equal {unit}; re-run prep tokenize and pack"
            )
        lengths += [meta.num_tokens // parts] * parts
    return lengths


def image_block_spans(
    pack: LoadedPack, row_ids: torch.Tensor, token_id: int, video_token_id: int | None = None
) -> torch.Tensor:
    """int32 [N, 2]: ``[start, end)`` row offsets (slot layout) of every image block of the pack, in order.

    Args:
        pack: The stored pack (its media say which sample each item belongs to, tiles, tokens).
        row_ids: The pack's row in the slot layout (`train.encoder.slot_layout`), [T].
        token_id: The model's image (soft) token id.
        video_token_id: The model's video (soft) token id where each video frame is a block too (Gemma 4).
    """
    ids = row_ids.numpy()
    cu, slots = pack.cu_seqlens, pack.cu_seqlens_padded
    kinds = {"image": token_id} if video_token_id is None else {"image": token_id, "video": video_token_id}
    spans: list[tuple[int, int]] = []
    for sample in range(len(cu) - 1):
        start, length = int(slots[sample]), int(cu[sample + 1] - cu[sample])
        mine: list[tuple[int, int]] = []
        for kind, kind_token in kinds.items():
            runs = token_runs(ids[start : start + length], kind_token)
            planned = planned_block_lengths(pack, sample, kind)
            found = [b - a for a, b in runs]
            unit = "tile" if kind == "image" else "frame"
            if found != planned:
                raise PlanMismatchError(
                    f"pack {pack.key}, sample {pack.sample_ids[sample]}: {kind}-token runs of lengths {found} in the "
                    f"row, but the stored media plan {planned} (soft tokens per {unit}, in order); the tokens and the "
                    "media plan disagree: re-run prep tokenize and pack"
                )
            mine += runs
        spans += [(start + a, start + b) for a, b in sorted(mine)]
    if not spans:
        return empty_spans()
    return torch.tensor(spans, dtype=torch.int32)
