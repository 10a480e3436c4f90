"""`train.plan`: the memory plan against what torch actually holds.

Truths: autograd's saved tensors of a real transformers decoder layer (the activation term),
the parameters of the materialised model and peft's adapters (the counts), the tensors a real
AdamW step allocates (parameters, gradients, optimizer state), and the arithmetic of sharding
written out by hand for Qwen2.5-VL-7B's published config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

from tests.train.models import make_family
from tests.train.recipes.test_hf import run_inputs  # noqa: F401  (the fixture)
from train.cli import main
from train.lora import LoraSettings, apply_lora
from train.models import load_model
from train.plan import GiB, LayerShape, PlanInputs, activation_bytes_per_token, model_shape, parse_memory, plan_memory
from train.trainable import freeze, group_sizes

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


GRID = torch.tensor([[1, 16, 16]])  # 256 patches


def _saved_bytes_of(model: torch.nn.Module, forward) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters excluded) in ``forward()``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def _saved_bytes(num_layers: int, tokens: int, dtype: torch.dtype) -> int:
    """Saved bytes of a transformers Qwen2 forward over ``tokens`` tokens."""
    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    return _saved_bytes_of(model, lambda: model.model(input_ids=torch.randint(0, 512, (1, tokens))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_per_token_match_autograds_saved_tensors(dtype: torch.dtype) -> None:
    precision = "fp32" if dtype is torch.float32 else "bf16"
    estimate = activation_bytes_per_token(LayerShape(hidden=256, intermediate=704, kv=128), precision)
    for tokens in (128, 512):  # linear in T: no T^2 attention matrix is kept
        per_layer = (_saved_bytes(3, tokens, dtype) - _saved_bytes(1, tokens, dtype)) / 2 / tokens
        assert abs(estimate - per_layer) <= 0.01 * per_layer, (estimate, per_layer)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "qwen2_5_omni"])
def test_meta_counts_equal_the_materialised_model_and_peft(family: str, tmp_path: Path) -> None:
    model_dir = make_family(family, tmp_path).model_dir
    shape = model_shape(AutoConfig.from_pretrained(model_dir), lora_rank=4)
    model = load_model(model_dir, seed=0, attn_implementation="sdpa")
    assert shape.group_params == group_sizes(model)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    apply_lora(model, LoraSettings(rank=4))
    assert shape.lora_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_state_bytes_equal_a_real_adamw_step_unsharded(tmp_path: Path) -> None:
    model_dir = make_family("qwen2_vl", tmp_path).model_dir
    model = load_model(model_dir, seed=0, attn_implementation="sdpa")
    freeze(model, ["vision"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()
    inputs = PlanInputs(sharding="none", precision="fp32", freeze=("vision",), tokens_per_microbatch=64)
    plan = plan_memory(model_shape(AutoConfig.from_pretrained(model_dir)), inputs)
    assert plan.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.gradients == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert plan.optimizer == sum(m.numel() * m.element_size() for m in moments)
    assert plan.compute == 0  # fp32 on one rank: no gathered or autocast copies


def test_sharding_arithmetic_for_qwen2_5_vl_7b() -> None:
    shape = model_shape(AutoConfig.from_pretrained(CONFIGS / "qwen2_5_vl_7b"))
    p = shape.num_params
    assert 8.2e9 < p < 8.4e9  # the published 8.29B
    replicated = plan_memory(shape, PlanInputs(world_size=8, sharding="none", gpu_memory_bytes=80 * GiB))
    assert replicated.parameters + replicated.optimizer == 12 * p and not replicated.fits  # the issue's ~112 GB
    full = plan_memory(shape, PlanInputs(world_size=8, sharding="full", gpu_memory_bytes=80 * GiB))
    assert (full.parameters, full.optimizer) == (4 * p // 8, 8 * p // 8) and full.fits
    assert full.gradients == 4 * p // 8 + (2 + 4) * shape.unit_params  # + the unit being reduced
    assert full.compute == 2 * (shape.root_params + 2 * shape.unit_params)
    assert full.optimizer_step == 4 * p // 8  # foreach AdamW: one fp32 temporary per parameter shard
    assert full.step_peak == 4 * p // 8 * 2 + 8 * p // 8 + 4 * p // 8  # the reduced unit's gradient is gone
    assert full.total == max(full.training_peak, full.step_peak)
    hybrid = plan_memory(shape, PlanInputs(world_size=16, gpus_per_node=8, sharding="hybrid"))
    assert hybrid.total == full.total  # one node's shard group, replicated across nodes
    with_adapters = model_shape(AutoConfig.from_pretrained(CONFIGS / "qwen2_5_vl_7b"), lora_rank=16)
    lora = plan_memory(with_adapters, PlanInputs(world_size=8, lora_rank=16))
    adapters = with_adapters.lora_params
    assert (lora.parameters, lora.optimizer) == (4 * (p + adapters) // 8, 8 * adapters // 8)
    layer = 16 * (2 * 3584 + 2 * (3584 + 512) + 3584 + 3584 + 3 * (3584 + 18944))  # q k v o gate up down
    assert with_adapters.unit_lora_params == layer and lora.gradients == 4 * adapters // 8 + 6 * layer
    assert 0 < adapters < 0.01 * p
    offload = plan_memory(shape, PlanInputs(world_size=8, cpu_offload=True))
    assert offload.parameters == offload.optimizer == offload.optimizer_step == 0  # the step runs on the host
    largest = max(shape.group_largest_tensor.values())  # the embedding, 152,064 x 3,584
    assert largest == 152064 * 3584 and offload.host == 16 * p // 8 + 3 * 4 * -(-largest // 8)
    no_ckpt = plan_memory(shape, PlanInputs(world_size=8, activation_checkpointing=False))
    per_token = activation_bytes_per_token(shape.text, "bf16")
    assert no_ckpt.activations - full.activations == 8192 * (shape.num_layers * per_token - per_token) - (
        shape.num_layers * 8192 * shape.text.hidden * 2
    )


def test_parse_memory() -> None:
    assert parse_memory("80GB") == parse_memory("80GiB") == parse_memory("80") == 80 * GiB
    assert parse_memory("512MB") == 512 << 20
    with pytest.raises(Exception, match="80GB"):
        parse_memory("eighty")


def test_train_hf_plan_prints_and_exits_without_training(run_inputs, tmp_path: Path) -> None:  # noqa: F811
    base = [
        "hf", "--data", str(run_inputs["data"]), "--model", str(run_inputs["model"]),
        "--processor", str(run_inputs["processor"]), "--output", str(tmp_path / "run"), "--max-steps", "1", "--plan",
    ]  # fmt: skip
    fits = CliRunner().invoke(main, [*base, "--gpu-memory", "80GB", "--plan-world-size", "2", "--freeze", "vision"])
    assert fits.exit_code == 0, fits.output
    assert "FITS in 80 GiB" in fits.output and "sharding full (shard group 2)" in fits.output
    assert "1,024 tokens per micro-batch" in fits.output  # the pack size of --data
    assert not (tmp_path / "run").exists()  # nothing claimed, nothing trained
    small = CliRunner().invoke(main, [*base, "--gpu-memory", "1MB"])
    assert small.exit_code == 0 and "DOES NOT FIT" in small.output
    bad = CliRunner().invoke(main, [*base, "--gpu-memory", "lots"])
    assert bad.exit_code == 2 and "80GB" in bad.output


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])  # ungated and gated MLP, fused qkv
def test_vision_bytes_per_patch_match_autograds_saved_tensors(family: str, tmp_path: Path) -> None:
    model_dir = make_family(family, tmp_path).model_dir
    base = json.loads((model_dir / "config.json").read_text())

    def saved(depth: int) -> tuple[int, Path]:
        config = json.loads(json.dumps(base))
        vision = config["vision_config"]
        vision.update({"depth": depth, "num_heads": 4, "fullatt_block_indexes": list(range(depth))})
        vision.update({"embed_dim": 256} if "embed_dim" in vision else {"hidden_size": 256, "intermediate_size": 512})
        directory = tmp_path / f"depth{depth}"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        model = load_model(directory, seed=0, attn_implementation="sdpa")
        patch = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        return _saved_bytes_of(model, lambda: model.model.visual(torch.randn(256, patch), grid_thw=GRID)), directory

    (deep, directory), (shallow, _) = saved(3), saved(1)
    per_patch = (deep - shallow) / 2 / 256
    shape = model_shape(AutoConfig.from_pretrained(directory))
    estimate = activation_bytes_per_token(shape.vision, "fp32")
    assert abs(estimate - per_patch) <= 0.01 * per_patch, (estimate, per_patch)


def _peak_bytes_during(fn) -> int:
    """Most CPU tensor bytes alive at once during ``fn()`` beyond those alive before it (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("foreach", [True, False])
def test_step_temporaries_equal_a_real_adamw_step(foreach: bool, tmp_path: Path) -> None:
    """The plan's ``step`` is what torch's AdamW allocates inside ``optimizer.step()``.

    foreach (CUDA's default): one fp32 ``sqrt(exp_avg_sq)`` per trainable tensor, all at once:
    exactly 4 Pt bytes (+ a few scalar tensors). Per-tensor loop (CPU's default): the tensor being
    updated's two temporaries and the previous one's ``denom``: at least 2 and at most 3 times
    the largest tensor, which the plan counts.
    """
    model_dir = make_family("qwen2_vl", tmp_path).model_dir
    model = load_model(model_dir, seed=0, attn_implementation="sdpa")
    freeze(model, ["vision"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    for param in trainable:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW(trainable, foreach=foreach)
    optimizer.step()  # the state exists from here on, as in every step after the first
    measured = _peak_bytes_during(optimizer.step)
    inputs = PlanInputs(sharding="none", precision="fp32", freeze=("vision",), foreach_optimizer=foreach)
    plan = plan_memory(model_shape(AutoConfig.from_pretrained(model_dir)), inputs)
    largest = max(p.numel() * p.element_size() for p in trainable)
    if foreach:
        assert 0 <= measured - plan.optimizer_step <= 4096, (measured, plan.optimizer_step)  # scalar step tensors
    else:
        assert plan.optimizer_step == 3 * largest and 2 * largest <= measured <= plan.optimizer_step, (
            measured,
            largest,
        )
    assert plan.step_peak == plan.parameters + plan.gradients + plan.optimizer + plan.optimizer_step
    assert plan.total == max(plan.training_peak, plan.step_peak)
