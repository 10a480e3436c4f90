"""`train megatron` as a command: flags, fail-fast without the GPU stack, media handling, the step.

The CPU tests run the click command and the loop's pure pieces; the `gpu` test checks that
`train_step` over two micro-batches gives the gradient of one micro-batch holding all their
samples (skipped without CUDA + Transformer Engine).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from click.testing import CliRunner

from packvlm.errors import ExitCode
from tests.train.megatron_batches import (
    DOC_SAMPLES,
    GPU_VOCAB,
    HAS_GPU_STACK,
    gpu_samples,
    make_batch,
    megatron_parallel_state,
)
from train.batch import PackedBatch
from train.cli import main as train_main
from train.megatron import forward_step
from train.recipes.megatron import megatron_command

pytestmark = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed"),
    pytest.mark.filterwarnings("ignore:Apex is not installed"),
]
GPU_ATOL = 2e-2  # bf16 autocast
GPU_GRAD_RTOL = 5e-2


def test_cli_help_documents_flags():
    result = CliRunner().invoke(megatron_command, ["--help"])
    assert result.exit_code == 0, result.output
    for flag in (
        "--data",
        "--processor",
        "--output",
        "--model-config",
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--max-steps",
        "--lr",
        "--seed",
        "--packs-per-microbatch",
        "--grad-accum",
        "--ignore-media",
        "--num-workers",
        "--sampling",
        "--shuffle-buffer-size",
        "--context-parallel-size",
    ):
        assert flag in result.output


@pytest.mark.skipif(HAS_GPU_STACK, reason="this machine has the GPU stack")
def test_cli_fails_fast_without_gpu_stack(tmp_path):
    args = ["--data", str(tmp_path / "none"), "--processor", str(tmp_path), "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(train_main, ["megatron", *args, "--max-steps", "1"])
    assert result.exit_code == ExitCode.RESOURCE, result.output  # the environment lacks it, not the command
    assert "Transformer Engine" in result.output and "pip install" in result.output
    assert not (tmp_path / "out").exists()  # nothing written before the check


def test_text_only_refuses_media_unless_ignored():
    from train.recipes.megatron import MediaInPackError, text_only

    plain = make_batch(DOC_SAMPLES)
    with_image = PackedBatch(
        **{n: getattr(plain, n) for n in plain.__slots__}
        | {"vision": {"image_grid_thw": torch.tensor([[1, 2, 2]])}, "num_media": 1}
    )
    assert list(text_only([plain], ignore_media=False)) == [plain]
    with pytest.raises(MediaInPackError, match=r"pack-00000007.*--ignore-media"):
        list(text_only([plain, with_image], ignore_media=False))
    assert list(text_only([with_image], ignore_media=True)) == [with_image]


def test_model_config_dir_defaults_to_processor_with_config_json(tmp_path):
    from train.dataset import TrainConfigError
    from train.recipes.megatron import MegatronTrainConfig, _model_config_dir

    config = MegatronTrainConfig(data=tmp_path, processor=tmp_path, output=tmp_path / "out", max_steps=1)
    with pytest.raises(TrainConfigError, match="--model-config"):
        _model_config_dir(config)
    (tmp_path / "config.json").write_text("{}")
    assert _model_config_dir(config) == tmp_path
    other = tmp_path / "model"
    assert _model_config_dir(dataclasses.replace(config, model_config=other)) == other


@pytest.fixture(scope="module")
def megatron_gpu():
    """A tiny GPTModel builder inside megatron-core's parallel state."""
    if not HAS_GPU_STACK:
        pytest.skip("needs a CUDA GPU, megatron-core and Transformer Engine")
    from train.megatron.model import GPTConfig, build_gpt_model

    config = GPTConfig(
        vocab_size=GPU_VOCAB, max_sequence_length=64, num_layers=2, hidden_size=128, num_attention_heads=4
    )
    with megatron_parallel_state():
        yield partial(build_gpt_model, config)


class GradRecorder:
    """Optimizer stand-in for train_step: keeps the gradients it was asked to apply."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": 0.0}]
        self.grads: list[torch.Tensor] = []

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


@pytest.mark.gpu
def test_train_step_accumulates_token_weighted_like_one_packed_batch_on_gpu(megatron_gpu):
    """Two micro-batches (2 + 1 samples) give the gradient of one micro-batch holding all three."""
    from train.distributed import DistContext
    from train.recipes.megatron import train_step

    model = megatron_gpu()
    samples = gpu_samples()
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    micro = [make_batch(samples[:2], pad_to_multiple_of=8), make_batch(samples[2:], pad_to_multiple_of=8)]
    recorder = GradRecorder(model.parameters())
    metrics = train_step(model, recorder, micro, ctx, step=1, max_grad_norm=1e9)
    assert metrics.num_label_tokens == sum(b.num_label_tokens for b in micro)
    whole = make_batch(samples, pad_to_multiple_of=8)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        output, loss_fn = forward_step(iter([whole]), model)
    loss, num_tokens, _ = loss_fn(output)
    (loss / num_tokens).backward()
    assert metrics.loss == pytest.approx((loss / num_tokens).item(), abs=GPU_ATOL)
    for (name, param), got in zip(model.named_parameters(), recorder.grads):
        scale = param.grad.abs().max().clamp(min=1e-3)
        assert ((got - param.grad).abs().max() / scale).item() < GPU_GRAD_RTOL, name
