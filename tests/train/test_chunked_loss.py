"""Chunked label-position loss equals the full-logit loss, and never holds ``[T, V]`` logits.

Truth: ``token_loss_sum(packed_forward(model, batch), batch.labels)`` (full ``[1, T, V]``
logits, itself checked against samples run alone in `test_equivalence.py`) and its gradients.
Tiny random models of every family `tests.train.models.FAMILIES` trains (Qwen2/2.5/3-VL,
GLM-4.1V/4.6V, the Qwen2.5/3-Omni thinkers) on the four-conversation pack (text-only, one
image, two images, text-only), float64 on CPU; text-only Gemma 2 (final logit softcapping) and
Cohere (logit scale) models for the post-processing rules; and every `prep example` family's
model for the premise (its forward returns its head's output unchanged).

Truth and candidate both run in float64 (`exact`), so the comparison holds at any thread
count and on any CPU: in fp32 the chunked and full paths differ only in the order of their sums
(the full path also sums the zeros of ignored positions), by a few ulps that move with the
number of threads (2 threads on an AMD EPYC: 4.3e-6 relative on a gradient entry). In fp64 a
reordered sum of N <= 2,000 terms moves by at most N * 1.1e-16 relative to the sum of its
magnitudes (~2e-13); the models' own fp32 islands (RMSNorm, rotary tables) see bit-identical
inputs on both paths. Measured here: <= 5e-16 relative on every loss and gradient. TOLERANCE
(1e-9, relative to max(1, |truth|)) sits far above that and far below what a real fault moves
(a dropped chunk, a wrong mask or shift: > 1e-3). One chunk gives bitwise-equal gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, CohereConfig, Gemma2Config

from families.processor import load_processor
from families.registry import example_families, example_family
from tests.train.models import CONVERSATIONS, FAMILIES, grads_of, make_family, pack_samples, process, tiny_model
from train import chunked_loss
from train.attention import PACKED_ATTENTION
from train.batch import IGNORE_INDEX, PackedBatch
from train.chunked_loss import DEFAULT_CHUNK_SIZE, OutputHeadError, chunked_token_loss_sum, identity_head, output_head
from train.encoder import PackEncoder
from train.forward import packed_forward
from train.loss import token_loss_sum, upcast

TOLERANCE = 1e-9  # relative to max(1, |truth|), both paths in float64 (see the docstring)
SMALL_CHUNK = 7  # far fewer rows than label positions: many chunks, and a ragged last one


@dataclasses.dataclass(frozen=True)
class Result:
    loss_sum: float
    count: int
    grads: dict[str, torch.Tensor]


def exact(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 (experts as plain loops: torch's grouped matmul has no fp64 kernel)."""
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")
    return model.double()


def full_logits(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, int]:
    return token_loss_sum(packed_forward(model, batch), batch.labels)


def run(model: torch.nn.Module, batch: PackedBatch, loss: Callable[..., tuple[torch.Tensor, int]]) -> Result:
    model.zero_grad(set_to_none=True)
    summed, count = loss(model, batch)
    summed.backward()
    result = Result(float(summed.detach()), count, grads_of(model))
    model.zero_grad(set_to_none=True)
    return result


def assert_equal(chunked: Result, full: Result) -> None:
    assert chunked.count == full.count
    assert abs(chunked.loss_sum - full.loss_sum) <= TOLERANCE * max(1.0, abs(full.loss_sum))
    assert chunked.grads.keys() == full.grads.keys()
    for name, truth in full.grads.items():
        grad_diff = float((chunked.grads[name] - truth).abs().max())
        assert grad_diff <= TOLERANCE * max(1.0, float(truth.abs().max())), name


@dataclasses.dataclass
class Setup:
    model: torch.nn.Module
    batch: PackedBatch


def build_setup(name: str, root: Path) -> Setup:
    family = make_family(name, root)
    processor = load_processor(str(family.processor_dir)).processor
    samples = [process(processor, c) for c in CONVERSATIONS]
    encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
    batch = encoder.encode(pack_samples(samples, family.processor_dir, pad_to_multiple_of=16))
    return Setup(exact(tiny_model(family)), batch)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return build_setup(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """One family for the checks that do not depend on the family (memory probe, Liger plumbing)."""
    return build_setup("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl_one"))


def mask_slot(batch: PackedBatch, index: int) -> PackedBatch:
    """The batch with every label of sample ``index`` ignored."""
    labels = batch.labels.clone()
    start, end = batch.cu_seqlens_padded[index : index + 2].tolist()
    labels[0, start:end] = IGNORE_INDEX
    return dataclasses.replace(batch, labels=labels)


@pytest.mark.parametrize("chunk_size", [SMALL_CHUNK, DEFAULT_CHUNK_SIZE])
def test_chunked_equals_full_logits(setup: Setup, chunk_size: int) -> None:
    full = run(setup.model, setup.batch, full_logits)
    assert full.count > 4 * SMALL_CHUNK
    chunked = run(setup.model, setup.batch, lambda m, b: chunked_token_loss_sum(m, b, chunk_size=chunk_size))
    assert_equal(chunked, full)
    assert any("visual" in name and float(g.abs().max()) > 0 for name, g in chunked.grads.items())


def test_a_sample_with_every_label_masked(setup: Setup) -> None:
    batch = mask_slot(setup.batch, 1)  # the one-image sample: its tokens still shape the others' nothing
    full = run(setup.model, batch, full_logits)
    assert 0 < full.count < setup.batch.num_label_tokens
    chunked = run(setup.model, batch, lambda m, b: chunked_token_loss_sum(m, b, chunk_size=SMALL_CHUNK))
    assert_equal(chunked, full)


def test_no_label_at_all_gives_zero_loss_and_zero_gradients(setup: Setup) -> None:
    batch = dataclasses.replace(setup.batch, labels=torch.full_like(setup.batch.labels, IGNORE_INDEX))
    full = run(setup.model, batch, full_logits)
    chunked = run(setup.model, batch, chunked_token_loss_sum)
    assert chunked.count == 0 and chunked.loss_sum == 0.0
    assert_equal(chunked, full)
    assert all(float(g.abs().max()) == 0.0 for g in chunked.grads.values())


class LargestVocabRows(TorchDispatchMode):
    """The most rows of any tensor an op produces whose last dimension is the vocabulary."""

    def __init__(self, vocab_size: int, weight_shape: torch.Size) -> None:
        super().__init__()
        self.vocab_size, self.weight_shape, self.rows = vocab_size, weight_shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            is_logits = isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.vocab_size
            if is_logits and tensor.shape != self.weight_shape and tensor.shape[::-1] != self.weight_shape:
                self.rows = max(self.rows, tensor.numel() // self.vocab_size)
        return out


def vocab_rows(setup: Setup, loss: Callable[..., tuple[torch.Tensor, int]]) -> tuple[int, int]:
    """Rows of the largest vocabulary-wide tensor any op produces in forward and backward, and
    rows of such tensors saved for the backward (both exclude the head's own weight)."""
    weight = setup.model.get_output_embeddings().weight
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if tensor.dim() >= 2 and tensor.shape[-1] == weight.shape[0] and tensor.shape != weight.shape[::-1]:
            saved += tensor.numel() // weight.shape[0]
        return tensor

    with LargestVocabRows(weight.shape[0], weight.shape) as probe:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            summed, _ = loss(setup.model, setup.batch)
        summed.backward()
    setup.model.zero_grad(set_to_none=True)
    return probe.rows, saved


def test_no_tensor_holds_more_than_a_chunk_of_logits(qwen2_vl: Setup) -> None:
    setup = qwen2_vl
    largest, saved = vocab_rows(setup, full_logits)
    assert largest == setup.batch.num_tokens and saved >= setup.batch.num_tokens - 1  # the probes see [T, V]
    largest, saved = vocab_rows(setup, lambda m, b: chunked_token_loss_sum(m, b, chunk_size=SMALL_CHUNK))
    assert largest == SMALL_CHUNK  # produced one chunk at a time
    assert saved == 0  # and none kept for the backward: each chunk is recomputed there


def test_liger_backend_gets_the_label_positions_head_and_softcap(
    qwen2_vl: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel is GPU-only; a pure-torch stand-in with its signature checks what we pass."""
    setup = qwen2_vl
    calls = []

    def fused(*, input, weight, target, bias, ignore_index, reduction, softcap):  # type: ignore[no-untyped-def]
        calls.append(input.shape[0])
        assert ignore_index == IGNORE_INDEX and reduction == "sum" and softcap is None
        return F.cross_entropy(upcast(F.linear(input, weight, bias)), target, reduction="sum")

    monkeypatch.setattr(chunked_loss, "liger_fused_linear_cross_entropy", lambda: fused)
    full = run(setup.model, setup.batch, full_logits)
    run(setup.model, setup.batch, chunked_token_loss_sum)  # auto: CPU tensors never go to Liger
    assert calls == []
    liger = run(setup.model, setup.batch, lambda m, b: chunked_token_loss_sum(m, b, backend="liger"))
    assert calls == [full.count]
    assert_equal(liger, full)


def text_model(config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return exact(AutoModelForCausalLM.from_config(config, attn_implementation=PACKED_ATTENTION).train())


def text_batch(vocab_size: int, lengths: tuple[int, ...] = (9, 14, 6)) -> PackedBatch:
    """Text-only samples; the first 3 tokens of each are a masked prompt."""
    input_ids = torch.randint(0, vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels[positions < 3] = IGNORE_INDEX
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(
        input_ids=input_ids, labels=labels, position_ids=positions, cu_seqlens=cu, cu_seqlens_padded=cu,
        max_seqlen=max(lengths), mm_token_type_ids=torch.zeros_like(input_ids),
    )  # fmt: skip


TEXT = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
TEXT |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def test_final_logit_softcapping_is_reproduced() -> None:
    """Gemma 2 caps its logits after the head; the chunked loss caps them the same way."""
    config = Gemma2Config(
        **TEXT, layer_types=["full_attention"] * 2, attn_logit_softcapping=None, final_logit_softcapping=2.0
    )
    model, batch = text_model(config), text_batch(config.vocab_size)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)  # logits of several units: the cap bites
    full = run(model, batch, full_logits)
    assert_equal(run(model, batch, lambda m, b: chunked_token_loss_sum(m, b, chunk_size=SMALL_CHUNK)), full)
    model.config.final_logit_softcapping = None
    assert abs(run(model, batch, full_logits).loss_sum - full.loss_sum) > 1.0  # the cap matters here


def test_a_post_processing_not_reproduced_is_refused() -> None:
    """Cohere multiplies its logits by logit_scale: refused loudly, not a silently different loss."""
    config = CohereConfig(**TEXT, logit_scale=0.0625)
    model, batch = text_model(config), text_batch(config.vocab_size)
    with pytest.raises(OutputHeadError, match="CohereForCausalLM.*post-processes the logits"):
        chunked_token_loss_sum(model, batch)
    assert model.get_output_embeddings().__dict__.get("forward") is None  # the head is its own again


@pytest.mark.parametrize("name", example_families())
def test_every_example_family_gives_its_head_output_unchanged(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """What the chunked loss relies on, for every family `prep example` writes a model for: the
    forward calls ``get_output_embeddings()`` once and returns its output as the logits (softcapped
    where the config declares ``final_logit_softcapping``)."""
    family = example_family(name)
    assert family.build_model is not None, f"example family {name} writes no model"
    root = tmp_path_factory.mktemp(name)
    model_dir = family.build_model(root / "model", family.build_processor(root / "processor"))
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")  # unpacked: no rule refuses
    head = output_head(model)
    with identity_head(head.module) as calls:
        logits = model(input_ids=torch.randint(0, 50, (1, 12)), attention_mask=None, use_cache=False).logits
    assert len(calls) == 1
    if head.softcap is None:
        assert logits is calls[0]
    else:  # Gemma 4's final_logit_softcapping: the one change `OutputHead.postprocess` reproduces, bit for bit
        assert torch.equal(logits, head.postprocess(calls[0]))
