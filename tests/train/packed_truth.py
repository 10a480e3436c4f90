"""The packed-vs-alone scaffolding every family's equivalence test shares.

A `Setup` holds one family's tiny model, the real processor's samples of a few named packs,
each pack's truth (every sample alone through the unmodified model: `tests.train.models.reference`)
and the `PackEncoder` under test; `build_setup` makes it once per module. What differs between
families comes in as arguments: the name fragment of the vision tower's parameters, the
parameters the data never reaches (the Omni thinkers' audio tower), and hooks for the processor
the truth renders with (Idefics3 / SmolVLM), the weights redrawn before the truth is taken (Gemma 3,
Qwen3.5) and how the truth is taken (Qwen3.5: transformers' own linear attention).

`assert_equals_alone` is the claim: per-token losses within `TOLERANCE` (absolute), the summed
loss and its token count, gradients of the summed loss within `TOLERANCE` as ``torch.allclose``
(`tests.train.models.max_grad_error`), every other parameter with a gradient, the vision tower's
non-zero. The mutation helpers make the bugs packing must not have; a mutation test asserts
that some per-token loss moves by more than `LARGE`, or that the model's own checks fire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from families.processor import load_processor
from schemas.packed import LoadedPack
from tests.train.models import (
    Conversation,
    Family,
    Sample,
    Truth,
    grads_of,
    make_family,
    max_grad_error,
    pack_samples,
    process,
    reference,
    scatter_truth,
    tiny_model,
)
from train.attention import VARLEN_KWARGS
from train.batch import IGNORE_INDEX, PackedBatch
from train.encoder import PackEncoder
from train.forward import packed_forward, packed_inputs
from train.loss import per_token_losses, token_loss_sum
from train.media import PlanMismatchError

TOLERANCE = 1e-5  # the bound for losses (absolute) and gradients (rtol = atol) in fp32
LARGE = 1e-2  # a mutation must move some per-token loss by 1000x the tolerance at least


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """One family's model, named packs of real-processor samples, their truths and the encoder."""

    family: Family
    model: PreTrainedModel
    samples: Mapping[str, list[Sample]]
    truth: Mapping[str, Truth]
    encoder: PackEncoder
    vision: str  # a name fragment of the vision tower's parameters
    untouched: tuple[str, ...]  # name fragments of the parameters the data never reaches

    @property
    def processor_dir(self) -> Path:
        return self.family.processor_dir

    def pack(
        self, name: str, pad_to_multiple_of: int = 1, *, order: Sequence[int] | None = None, key: str | None = None
    ) -> LoadedPack:
        """Pack ``name`` as `prep pack` stores it (``order``: those of its samples, in that order)."""
        samples = self.samples[name]
        chosen = samples if order is None else [samples[i] for i in order]
        return pack_samples(
            chosen, self.processor_dir, pad_to_multiple_of=pad_to_multiple_of, key=key or f"pack-{name}"
        )

    def encode(
        self, name: str, pad_to_multiple_of: int = 1, *, order: Sequence[int] | None = None, key: str | None = None
    ) -> PackedBatch:
        return self.encoder.encode(self.pack(name, pad_to_multiple_of, order=order, key=key))

    def truth_of(self, *names: str) -> Truth:
        """Several packs' truths as one row's (per-sample losses in order, gradients summed)."""
        parts = [self.truth[n] for n in names]
        grads = {k: sum(p.grads[k] for p in parts) for k in parts[0].grads}
        return Truth([loss for p in parts for loss in p.losses], grads)

    def samples_of(self, *names: str) -> list[Sample]:
        return [s for n in names for s in self.samples[n]]


def stock_processor(family: Family) -> object:
    """The family's processor as `prep` loads it (what the truth renders and processes with)."""
    return load_processor(str(family.processor_dir)).processor


def build_setup(
    name: str,
    root: Path,
    packs: Mapping[str, Sequence[Conversation]],
    *,
    vision: str,
    untouched: tuple[str, ...] = (),
    processor: Callable[[Family], object] = stock_processor,
    prepare: Callable[[PreTrainedModel], None] | None = None,
    truth: Callable[[PreTrainedModel, list[Sample]], Truth] = reference,
) -> Setup:
    """Example family ``name`` under ``root``: each pack's samples through the real processor and
    their truths (``prepare`` edits the weights first), the model and the encoder."""
    torch.manual_seed(0)
    family = make_family(name, root)
    rendering = processor(family)
    samples = {pack: [process(rendering, c) for c in conversations] for pack, conversations in packs.items()}
    model = tiny_model(family)
    if prepare is not None:
        prepare(model)
    truths = {pack: truth(model, s) for pack, s in samples.items()}
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    return Setup(
        family=family,
        model=model,
        samples=samples,
        truth=truths,
        encoder=encoder,
        vision=vision,
        untouched=untouched,
    )


def loss_diff(truth: Truth, batch: PackedBatch, losses: torch.Tensor) -> float:
    """Largest |packed - alone| over every predicted position of the row."""
    expected = scatter_truth(truth, batch.cu_seqlens_padded, batch.num_tokens)
    return float((losses.detach().reshape(-1) - expected).abs().max())


@torch.no_grad()
def varlen_losses(setup: Setup, batch: PackedBatch, **overrides: object) -> torch.Tensor:
    """Per-token losses of the varlen path; ``overrides`` replace keywords of the packed call."""
    return per_token_losses(setup.model(**(packed_inputs(setup.model, batch) | overrides)).logits, batch.labels)


@torch.no_grad()
def positions_losses(
    setup: Setup, batch: PackedBatch, *, use_cache: bool = False, attention: str = "sdpa"
) -> torch.Tensor:
    """Per-token losses when transformers infers the boundaries from position_ids (``attention``:
    stock SDPA; flash-attention applies the same rule), with no boundaries passed."""
    inputs = {k: v for k, v in packed_inputs(setup.model, batch).items() if k not in VARLEN_KWARGS}
    previous = setup.model.config._attn_implementation
    setup.model.set_attn_implementation(attention)
    try:
        return per_token_losses(setup.model(**inputs | {"use_cache": use_cache}).logits, batch.labels)
    finally:
        setup.model.set_attn_implementation(previous)


def assert_equals_alone(setup: Setup, batch: PackedBatch, *packs: str) -> dict[str, torch.Tensor]:
    """The row of ``packs`` (joined in that order) trains as their samples alone: per-token losses,
    the summed loss and its count, its gradients (returned), every parameter reached, the tower moved."""
    truth, samples = setup.truth_of(*packs), setup.samples_of(*packs)
    setup.model.zero_grad(set_to_none=True)
    logits = packed_forward(setup.model, batch)
    assert loss_diff(truth, batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    summed, count = token_loss_sum(logits, batch.labels)
    assert count == sum(int((s.labels[0, 1:] != IGNORE_INDEX).sum()) for s in samples)
    assert abs(float(summed.detach()) - float(sum(t.sum() for t in truth.losses))) <= TOLERANCE * count
    summed.backward()
    packed = grads_of(setup.model)
    setup.model.zero_grad(set_to_none=True)
    assert max_grad_error(packed, truth.grads) <= TOLERANCE  # allclose, rtol = atol = 1e-5
    missing = sorted({n for n, _ in setup.model.named_parameters()} - packed.keys())
    assert all(any(part in n for part in setup.untouched) for n in missing), missing[:3]
    assert any(setup.vision in n and float(g.abs().max()) > 0 for n, g in packed.items())
    return packed


def continuing_positions(batch: PackedBatch) -> PackedBatch:
    """Mutation: 1-D positions 0..T-1 over the whole row (samples continue each other)."""
    return dataclasses.replace(batch, position_ids=torch.arange(batch.num_tokens)[None])


def one_slot(batch: PackedBatch) -> PackedBatch:
    """Mutation: the whole row as one slot (attention crosses samples)."""
    whole = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    return dataclasses.replace(batch, cu_seqlens_padded=whole, max_seqlen=batch.num_tokens)


def unmasked_first_labels(batch: PackedBatch) -> PackedBatch:
    """Mutation: every sample's first token a label (the previous sample's last token predicts it)."""
    labels = batch.labels.clone()
    starts = batch.cu_seqlens_padded[1:-1].long()
    labels[0, starts] = batch.input_ids[0, starts]
    return dataclasses.replace(batch, labels=labels)


def with_stored(pack: LoadedPack, index: int, **changes: object) -> LoadedPack:
    """``pack`` with media item ``index``'s stored facts changed (what a stale plan would hold)."""
    media = list(pack.media)
    media[index] = dataclasses.replace(media[index], meta=dataclasses.replace(media[index].meta, **changes))
    meta = dataclasses.replace(pack.meta, media=tuple(m.meta for m in media))
    return dataclasses.replace(pack, meta=meta, media=tuple(media))


def assert_plan_mismatch(setup: Setup, pack: LoadedPack, index: int, field: str, wrong: object) -> None:
    """Media item ``index`` stored with ``field`` = ``wrong``: `PlanMismatchError` naming the pack,
    the item's sample and member, the processor's value and the stored one."""
    meta = pack.media[index].meta
    with pytest.raises(PlanMismatchError) as error:
        setup.encoder.encode(with_stored(pack, index, **{field: wrong}))
    origin = f"pack {pack.key}, sample {pack.sample_ids[meta.sample]}, member {meta.member}"
    values = f"processor {field} {getattr(meta, field)} != stored {field} {wrong}"
    assert f"{origin}: {values}" in str(error.value).replace("[", "(").replace("]", ")"), str(error.value)
