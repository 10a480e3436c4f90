"""The Megatron path: PackedBatch -> PackedSeqParams / Megatron-LM batch, step and loss.

CPU tests check hand-computed values for known packs (the `train.batch` docstring pack and
its unpadded twin), a per-sample oracle for random packs, the loss reduction over
micro-batches, the context-parallel check and the guarded imports. The `gpu` test runs a
megatron-core GPTModel (Transformer Engine spec) and checks that packed per-token losses
equal each sample run alone; it is skipped without CUDA + Transformer Engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.train.megatron_batches import (
    A0,
    A1,
    A2,
    B0,
    B1,
    DOC_SAMPLES,
    GPU_VOCAB,
    HAS_GPU_STACK,
    HAS_MEGATRON,
    PAD,
    gpu_samples,
    make_batch,
    megatron_parallel_state,
)
from train.batch import IGNORE_INDEX, PackedBatch
from train.megatron import (
    ContextParallelPaddingError,
    MegatronNotInstalledError,
    check_context_parallel,
    forward_step,
    get_batch,
    loss_func,
    mrope_position_ids,
    packed_seq_fields,
    packed_seq_params,
    shift_labels,
)
from train.megatron.model import require_megatron_gpu

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed"),
    pytest.mark.filterwarnings("ignore:Apex is not installed"),
]


def test_docstring_pack_is_the_documented_row():
    batch = make_batch(DOC_SAMPLES, pad_to_multiple_of=4)
    assert batch.input_ids.tolist() == [[A0, A1, A2, PAD, B0, B1, PAD, PAD]]
    assert batch.labels.tolist() == [[-100, A1, A2, -100, -100, B1, -100, -100]]
    assert batch.max_seqlen == 4


def test_packed_seq_fields_padded():
    fields = packed_seq_fields(make_batch(DOC_SAMPLES, pad_to_multiple_of=4))
    assert fields.qkv_format == "thd"
    assert fields.cu_seqlens_q.tolist() == fields.cu_seqlens_kv.tolist() == [0, 3, 5]
    assert fields.cu_seqlens_q_padded.tolist() == fields.cu_seqlens_kv_padded.tolist() == [0, 4, 8]
    assert fields.max_seqlen_q == fields.max_seqlen_kv == 4
    assert type(fields.max_seqlen_q) is int
    for t in (fields.cu_seqlens_q, fields.cu_seqlens_kv, fields.cu_seqlens_q_padded, fields.cu_seqlens_kv_padded):
        assert t.dtype == torch.int32


def test_packed_seq_fields_unpadded():
    fields = packed_seq_fields(make_batch(DOC_SAMPLES))
    assert fields.cu_seqlens_q.tolist() == [0, 3, 5]
    assert fields.cu_seqlens_q_padded.tolist() == [0, 3, 5]  # passed even when equal (see params.py)
    assert fields.max_seqlen_q == 3


def test_packed_seq_fields_casts_int64_boundaries_to_int32():
    batch = make_batch(DOC_SAMPLES)
    batch = PackedBatch(**{n: getattr(batch, n) for n in batch.__slots__} | {"cu_seqlens": batch.cu_seqlens.long()})
    assert packed_seq_fields(batch).cu_seqlens_q.dtype == torch.int32


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
def test_packed_seq_params_is_megatron_core_class_with_the_same_values():
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = make_batch(DOC_SAMPLES, pad_to_multiple_of=4)
    params = packed_seq_params(batch)
    assert isinstance(params, PackedSeqParams)
    fields = packed_seq_fields(batch)
    for name in fields.__slots__:
        mine, theirs = getattr(fields, name), getattr(params, name)
        assert (mine.tolist() == theirs.tolist()) if isinstance(mine, torch.Tensor) else mine == theirs, name
    assert params.cu_seqlens_q.device == batch.cu_seqlens.device
    # every field we set exists on the real class (a rename there fails here, not on a GPU)
    assert set(fields.__slots__) <= {f.name for f in dataclasses.fields(PackedSeqParams)}


def test_get_batch_padded_hand_values():
    mb = get_batch(make_batch(DOC_SAMPLES, pad_to_multiple_of=4))
    assert mb.tokens.tolist() == [[A0, A1, A2, PAD, B0, B1, PAD, PAD]]
    assert mb.labels.tolist() == [[A1, A2, 0, 0, B1, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    assert mb.loss_mask.dtype == torch.float32
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert mb.attention_mask is None
    assert mb.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 4, 8]


def test_get_batch_unpadded_hand_values():
    batch = make_batch(DOC_SAMPLES)
    mb = get_batch(batch)
    assert mb.tokens.tolist() == [[A0, A1, A2, B0, B1]]
    # position 2 (a2, last of sample a) must not get b0 as target; the row's last position has none
    assert mb.labels.tolist() == [[A1, A2, 0, B1, 0]]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 1, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert int(mb.loss_mask.sum()) == batch.num_label_tokens == 3


def test_prompt_tokens_are_masked_after_the_shift():
    # sample a: prompt a0 a1 (labels -100), answer a2 a3; the target of a1 is a2 (first answer token)
    batch = make_batch([([A0, A1, A2, 14], [IGNORE_INDEX, IGNORE_INDEX, A2, 14])])
    labels, loss_mask = shift_labels(batch)
    assert labels.tolist() == [[0, A2, 14, 0]]
    assert loss_mask.tolist() == [[0, 1, 1, 0]]


def test_boundary_is_structural_even_if_first_label_left_unmasked():
    """Mutation: a producer forgot to mask b0's label; a2 still never learns to predict b0."""
    broken = make_batch([([A0, A1, A2], [IGNORE_INDEX, A1, A2]), ([B0, B1], [B0, B1])])
    labels, loss_mask = shift_labels(broken)
    assert labels[0, 2] == 0 and loss_mask[0, 2] == 0
    assert labels.tolist() == [[A1, A2, 0, B1, 0]]


def test_multimodal_layout_gives_text_row_and_mrope_rows():
    batch = make_batch(DOC_SAMPLES, pad_to_multiple_of=4, multimodal=True)
    assert get_batch(batch).position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    rows = mrope_position_ids(batch)
    assert rows.shape == (3, 1, 8) and rows[0, 0, 0] == 100 and rows[2, 0, 5] == 301
    with pytest.raises(ValueError, match="text-only"):
        mrope_position_ids(make_batch(DOC_SAMPLES))


@st.composite
def packs(draw):
    n = draw(st.integers(1, 5))
    samples = []
    for i in range(n):
        length = draw(st.integers(1, 9))
        tokens = [100 * (i + 1) + j for j in range(length)]
        keep = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        labels = [t if k else IGNORE_INDEX for t, k in zip(tokens, keep)]
        labels[0] = IGNORE_INDEX
        samples.append((tokens, labels))
    return samples, draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=200, deadline=None)
@given(packs())
def test_shift_equals_each_sample_shifted_alone(case):
    """Oracle: a sample alone is shifted by hand; the packed row holds exactly that in its slot."""
    samples, multiple = case
    batch = make_batch(samples, pad_to_multiple_of=multiple)
    labels, loss_mask = shift_labels(batch)
    expected_labels, expected_mask = [], []
    for tokens, sample_labels in samples:
        slot = -(-len(tokens) // multiple) * multiple
        alone = [sample_labels[j + 1] if j + 1 < len(tokens) else IGNORE_INDEX for j in range(len(tokens))]
        expected_labels += [0 if x == IGNORE_INDEX else x for x in alone] + [0] * (slot - len(tokens))
        expected_mask += [float(x != IGNORE_INDEX) for x in alone] + [0.0] * (slot - len(tokens))
    assert labels.tolist() == [expected_labels]
    assert loss_mask.tolist() == [expected_mask]
    assert int(loss_mask.sum()) == batch.num_label_tokens
    # no target is ever a token of another sample (sample i's tokens are 100*(i+1) + j)
    for t in torch.nonzero(loss_mask[0]).flatten().tolist():
        assert labels[0, t] // 100 == batch.input_ids[0, t] // 100


def test_loss_func_sums_and_counts_like_megatron_lm():
    loss, num_tokens, report = loss_func(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert loss.item() == 7.0 and num_tokens.item() == 3 and num_tokens.dtype == torch.int32
    assert report["lm loss"].tolist() == [7.0, 3.0]


def test_loss_reduction_over_two_microbatches_is_token_weighted():
    """Megatron-LM sums (loss, num_tokens) over micro-batches, then divides: 27 / 4, not the mean of means."""
    first = loss_func(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    second = loss_func(torch.tensor([[0.0, 1.0]]), torch.tensor([[10.0, 20.0]]))
    total = torch.vstack([first[2]["lm loss"], second[2]["lm loss"]]).sum(dim=0)  # training.py's reduction
    assert (total[0] / total[1]).item() == pytest.approx((1 + 2 + 4 + 20) / 4)  # 6.75
    assert (first[0] + second[0]).item() / (first[1] + second[1]).item() == pytest.approx(6.75)
    mean_of_means = (7 / 3 + 20 / 1) / 2
    assert abs(mean_of_means - 6.75) > 1


def test_loss_func_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="losses"):
        loss_func(torch.ones(1, 4), torch.ones(1, 5))


def test_context_parallel_check():
    padded4 = make_batch(DOC_SAMPLES, pad_to_multiple_of=4)
    check_context_parallel(padded4, 1)
    check_context_parallel(padded4, 2)  # slots of 4 = 2 x cp 2
    with pytest.raises(ContextParallelPaddingError, match=r"pad-to-multiple-of 8") as err:
        check_context_parallel(padded4, 4)
    assert "example:0:0" in str(err.value) and "pack-00000007" in str(err.value)
    with pytest.raises(ContextParallelPaddingError, match=r"pad-to-multiple-of 4"):
        check_context_parallel(make_batch(DOC_SAMPLES), 2)  # slot of 3 tokens
    with pytest.raises(ValueError):
        check_context_parallel(padded4, 0)


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
def test_packed_seq_params_checks_context_parallel():
    with pytest.raises(ContextParallelPaddingError):
        packed_seq_params(make_batch(DOC_SAMPLES), context_parallel_size=2)


class RecordingModel(torch.nn.Module):
    """Stands in for GPTModel: records the call, returns one 'loss' per position."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.calls: list[tuple[tuple, dict]] = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        tokens = args[0]
        return self.weight * torch.arange(tokens.shape[1], dtype=torch.float32).view(1, -1)


def test_forward_step_calls_the_model_like_megatron_lm():
    batch = make_batch(DOC_SAMPLES, pad_to_multiple_of=4)
    model = RecordingModel()
    output, loss_fn = forward_step(iter([batch]), model)
    assert isinstance(loss_fn, partial) and loss_fn.func is loss_func
    (tokens, position_ids, attention_mask), kwargs = model.calls[0]
    assert tokens.tolist() == batch.input_ids.tolist()
    assert position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert attention_mask is None
    assert kwargs["labels"].tolist() == [[A1, A2, 0, 0, B1, 0, 0, 0]]
    assert kwargs["packed_seq_params"].qkv_format == "thd"
    loss, num_tokens, _ = loss_fn(output)
    assert loss.item() == 0 + 1 + 4 and num_tokens.item() == 3  # positions 0, 1, 4
    loss.backward()
    assert model.weight.grad.item() == 5.0


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
def test_forward_step_call_binds_to_gpt_model_forward():
    from megatron.core.models.gpt import GPTModel

    model = RecordingModel()
    forward_step(iter([make_batch(DOC_SAMPLES)]), model)
    args, kwargs = model.calls[0]
    bound = inspect.signature(GPTModel.forward).bind(object(), *args, **kwargs)
    assert bound.arguments["attention_mask"] is None
    assert bound.arguments["input_ids"] is args[0]
    assert bound.arguments["packed_seq_params"] is kwargs["packed_seq_params"]


def test_imports_and_errors_without_megatron(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", None)  # import raises ImportError
    with pytest.raises(MegatronNotInstalledError, match=r"packvlm\[megatron\]"):
        packed_seq_params(make_batch(DOC_SAMPLES))
    fields = packed_seq_fields(make_batch(DOC_SAMPLES))  # the pure layer needs no megatron
    assert fields.qkv_format == "thd"


@pytest.mark.skipif(HAS_GPU_STACK, reason="this machine has the GPU stack")
def test_require_megatron_gpu_says_what_to_install():
    with pytest.raises(MegatronNotInstalledError) as err:
        require_megatron_gpu()
    message = str(err.value)
    assert "Transformer Engine" in message and "packvlm[megatron]" in message and "train hf" in message


# ---------------------------------------------------------------- GPU: megatron-core + TE, end to end

GPU_ATOL = 2e-2  # bf16 autocast; THD kernel vs ordinary causal kernel
GPU_GRAD_RTOL = 5e-2


@pytest.fixture(scope="module")
def megatron_gpu():
    """Megatron's parallel state (tp = pp = 1) in a one-process NCCL group, and a tiny GPTModel."""
    if not HAS_GPU_STACK:
        pytest.skip("needs a CUDA GPU, megatron-core and Transformer Engine")
    from train.megatron.model import GPTConfig, build_gpt_model

    config = GPTConfig(
        vocab_size=GPU_VOCAB, max_sequence_length=64, num_layers=2, hidden_size=128, num_attention_heads=4
    )
    with megatron_parallel_state():
        yield partial(build_gpt_model, config)


def per_sample_losses(model, samples) -> list[torch.Tensor]:
    """Each sample alone, unpacked: ordinary causal attention, no packed_seq_params."""
    out = []
    for sample in samples:
        mb = get_batch(make_batch([sample]), "cuda")
        out.append(model(mb.tokens, mb.position_ids, None, labels=mb.labels)[0])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "pad_to_multiple_of", "atol"),
    [
        (torch.bfloat16, 1, GPU_ATOL),
        (torch.bfloat16, 8, GPU_ATOL),
        # fp32 runs TE's unfused attention, which handles THD only without slot padding
        (torch.float32, 1, 1e-4),
    ],
)
def test_packed_losses_equal_each_sample_alone_on_gpu(megatron_gpu, dtype, pad_to_multiple_of, atol):
    model = megatron_gpu()
    samples = gpu_samples()
    batch = make_batch(samples, pad_to_multiple_of=pad_to_multiple_of)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        packed, loss_fn = forward_step(iter([batch]), model)
        alone = per_sample_losses(model, samples)
    assert packed.shape == (1, batch.num_tokens)
    starts = batch.cu_seqlens_padded[:-1].tolist()
    for (tokens, _), start, reference in zip(samples, starts, alone):
        got = packed[0, start : start + len(tokens)].float()
        torch.testing.assert_close(got, reference.float(), atol=atol, rtol=0)
    loss, num_tokens, _ = loss_fn(packed)
    mask = get_batch(batch).loss_mask[0]
    expected = sum((ref.float().cpu() * mask[s : s + len(t)]).sum() for (t, _), s, ref in zip(samples, starts, alone))
    assert num_tokens.item() == batch.num_label_tokens
    torch.testing.assert_close(loss.cpu(), expected, atol=atol * num_tokens.item(), rtol=0)


@pytest.mark.gpu
def test_packed_gradients_equal_sum_of_per_sample_gradients_on_gpu(megatron_gpu):
    model = megatron_gpu()
    samples = gpu_samples()
    batch = make_batch(samples, pad_to_multiple_of=8)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed, loss_fn = forward_step(iter([batch]), model)
    loss_fn(packed)[0].backward()
    packed_grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for sample in samples:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, fn = forward_step(iter([make_batch([sample])]), model)
        fn(out)[0].backward()
    for (name, param), got in zip(model.named_parameters(), packed_grads):
        scale = param.grad.abs().max().clamp(min=1e-3)
        assert ((got - param.grad).abs().max() / scale).item() < GPU_GRAD_RTOL, name


@pytest.mark.gpu
def test_a_few_forward_steps_train_on_gpu(megatron_gpu):
    model = megatron_gpu()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = make_batch(gpu_samples(), pad_to_multiple_of=8)
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output, loss_fn = forward_step(iter([batch]), model)
        loss, num_tokens, report = loss_fn(output)
        (loss / num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((report["lm loss"][0] / report["lm loss"][1]).item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
