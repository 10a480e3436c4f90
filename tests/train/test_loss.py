"""Token-sum loss: the HF shift, ignored labels, fp32, and one global normaliser."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from train.batch import IGNORE_INDEX, PackedBatch
from train.loss import global_label_tokens, per_token_losses, token_loss_sum

VOCAB = 11


def peaked_logits(targets: list[int]) -> torch.Tensor:
    """Logits [1, T, V] whose position t puts almost all mass on ``targets[t]``."""
    logits = torch.full((1, len(targets), VOCAB), -30.0)
    for t, target in enumerate(targets):
        logits[0, t, target] = 30.0
    return logits


def test_logits_at_t_predict_label_at_t_plus_one() -> None:
    labels = torch.tensor([[IGNORE_INDEX, 3, 7, 2]])
    shifted = peaked_logits([3, 7, 2, 0])  # position t predicts labels[t + 1]
    summed, count = token_loss_sum(shifted, labels)
    assert count == 3 and float(summed) < 1e-6
    unshifted, _ = token_loss_sum(peaked_logits([0, 3, 7, 2]), labels)
    assert float(unshifted) > 100.0


def test_ignored_labels_carry_no_loss_and_no_count() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, VOCAB, generator=generator)
    labels = torch.tensor([[5, IGNORE_INDEX, 4, IGNORE_INDEX, IGNORE_INDEX, 9]])
    losses = per_token_losses(logits, labels)
    assert losses.shape == (1, 5)
    assert losses[0, [0, 2, 3]].eq(0).all()  # targets labels[1], labels[3], labels[4] are ignored
    summed, count = token_loss_sum(logits, labels)
    assert count == 2  # labels[0] is never a target: nothing predicts the first token
    torch.testing.assert_close(summed, losses.sum())
    expected = F.cross_entropy(logits[0, [1, 4]], torch.tensor([4, 9]), reduction="sum")
    torch.testing.assert_close(summed, expected)


def test_low_precision_logits_are_upcast() -> None:
    logits = torch.randn(1, 5, VOCAB, generator=torch.Generator().manual_seed(1)).bfloat16()
    labels = torch.tensor([[1, 2, 3, 4, 5]])
    summed, _ = token_loss_sum(logits, labels)
    assert summed.dtype == torch.float32
    torch.testing.assert_close(summed, per_token_losses(logits.float(), labels).sum())


def test_global_normaliser_weighs_every_token_equally() -> None:
    """Sum of (micro-batch loss sum / global count) = mean over all label tokens, however split."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 12, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (1, 12), generator=generator)
    labels[0, [0, 4, 5, 9]] = IGNORE_INDEX
    mean = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE_INDEX)
    parts = [(logits[:, :4], labels[:, :4]), (logits[:, 4:], labels[:, 4:])]  # split at a masked label
    total = sum(token_loss_sum(lg, lb)[1] for lg, lb in parts)
    assert math.isclose(float(sum(token_loss_sum(lg, lb)[0] for lg, lb in parts) / total), float(mean), rel_tol=1e-6)


def batch_with_labels(labels: list[int]) -> PackedBatch:
    row = torch.tensor([labels])
    cu = torch.tensor([0, len(labels)], dtype=torch.int32)
    return PackedBatch(
        input_ids=row.clamp_min(0), labels=row, position_ids=torch.arange(len(labels))[None],
        cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=len(labels), mm_token_type_ids=torch.zeros_like(row),
    )  # fmt: skip


def test_global_label_tokens_without_and_with_a_process_group(tmp_path: Path) -> None:
    batches = [batch_with_labels([IGNORE_INDEX, 1, 2]), batch_with_labels([IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7])]
    assert global_label_tokens(batches) == 5
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert global_label_tokens(batches) == 5
        assert global_label_tokens(batches, group=dist.new_group([0])) == 5
    finally:
        dist.destroy_process_group()
