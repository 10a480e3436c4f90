"""FSDP2 sharding and activation checkpointing of `train hf`, against one process (CPU, gloo).

Truth: the same global batch trained by one process without any sharding (`run_alone`: every
rank's micro-batches in turn, gradients summed locally). Two gloo ranks (`run_ranks`) each train
their own micro-batches with `train hf`'s own step, the model loaded and sharded by
`train.sharding`. The micro-batches are laid out so that at every micro-batch one rank holds
images and the other text only (step 2: rank 0 holds no image at all), which hangs FSDP unless
`train.vision_sync` keeps the vision tower's collectives in step.

Precision: both runs are float64 end to end (the chunked loss keeps a float64 model's logits in
float64), so the only differences are float64 sums taken in another order (per-rank partial sums,
then a reduce-scatter, against one running sum): at most ~n * 1.1e-16 relative for n addends
(n <= 1e4 here), i.e. 1e-12 with room to spare. Every bug this guards against moves numbers by far
more: a mean instead of a sum of rank gradients halves the gradient norm, a missed reduction or a
vision tower left out changes weights by ~lr.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.train.models import CONVERSATIONS, grads_of, make_family, max_grad_error, pack_samples, process, tiny_model
from tests.train.packed_truth import stock_processor
from tests.train.sharded_run import RunResult, RunSpec, run_alone, run_ranks
from train.batch import PackedBatch
from train.chunked_loss import chunked_token_loss_sum
from train.distributed import DistContext
from train.encoder import PackEncoder
from train.models import load_model
from train.sharding import ShardingError, enable_activation_checkpointing, layer_modules, resolve_plan
from train.vision_sync import UnsupportedVisionTowerError, vision_calls, zero_image

FAMILIES = {"qwen2_vl": "visual", "gemma3": "vision_tower", "qwen3_5": "visual"}  # family: vision tower name
TIGHT = 1e-12  # float64, another summation order (module docstring)


@dataclasses.dataclass(frozen=True)
class FamilyRun:
    model_dir: Path
    batches: dict[str, PackedBatch]
    truth: dict[str, RunResult] = dataclasses.field(default_factory=dict)

    @property
    def alone(self) -> RunResult:
        """The one-process run of `spec`'s packs (computed once)."""
        if "alone" not in self.truth:
            self.truth["alone"] = run_alone(self.spec())
        return self.truth["alone"]

    def spec(self, **overrides: object) -> RunSpec:
        b = self.batches
        steps = [[[b["img"], b["txt"]], [b["txt2"], b["img2"]]], [[b["txt"], b["txt2"]], [b["img"], b["img2"]]]]
        return RunSpec(model_dir=self.model_dir, steps=steps, **overrides)  # type: ignore[arg-type]


def _weights_dir(family_model_dir: Path, out: Path) -> Path:
    """Gemma 3: its zero-initialised projector would keep the vision tower's gradient at zero; a
    saved checkpoint with a drawn one (which also takes the from_pretrained path of loading)."""
    model = load_model(family_model_dir, seed=0, attn_implementation="packvlm_varlen")
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.save_pretrained(out)
    shutil.copy(family_model_dir / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def family_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], FamilyRun]:
    built: dict[str, FamilyRun] = {}

    def build(name: str) -> FamilyRun:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            family = make_family(name, root)
            processor = stock_processor(family)
            samples = [process(processor, c) for c in CONVERSATIONS]
            encoder = PackEncoder.from_pretrained(str(family.processor_dir), str(family.model_dir))
            packs = {"img": [1, 0], "img2": [2, 3], "txt": [0, 3], "txt2": [3]}
            batches = {
                key: encoder.encode(pack_samples([samples[i] for i in idx], family.processor_dir, key=key))
                for key, idx in packs.items()
            }
            model_dir = _weights_dir(family.model_dir, root / "weights") if name == "gemma3" else family.model_dir
            built[name] = FamilyRun(model_dir, batches)
        return built[name]

    return build


def assert_same_run(run: RunResult, truth: RunResult, spec: RunSpec) -> None:
    assert run.label_tokens == truth.label_tokens
    assert run.losses == pytest.approx(truth.losses, rel=TIGHT, abs=0)
    assert run.grad_norms == pytest.approx(truth.grad_norms, rel=TIGHT, abs=0)
    assert max(truth.grad_norms) > spec.max_grad_norm  # clipping took part, with the global norm
    assert run.weights.keys() == truth.weights.keys()
    for name, tensor in truth.weights.items():
        torch.testing.assert_close(run.weights[name], tensor, rtol=TIGHT, atol=TIGHT, msg=name)


def assert_sharded(run: RunResult, truth: RunResult, shards: int) -> None:
    """Rank 0 holds its dim-0 slice of each parameter (the first ceil(rows / shards) rows) and AdamW
    state for that slice alone: the equality above is not a replicated run's."""
    assert run.shapes == truth.shapes
    expected = sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in truth.shapes)
    assert run.local_numel == expected < truth.local_numel == sum(math.prod(shape) for shape in truth.shapes)
    assert run.local_state_numel == 2 * expected and truth.local_state_numel == 2 * truth.local_numel


def assert_trained(result: RunResult, model_dir: Path, vision: str) -> None:
    """Every layer and vision block moved from its initial value (weight decay is 0: a gradient reached it)."""
    initial = load_model(model_dir, seed=0, dtype=torch.float64, attn_implementation="packvlm_varlen").state_dict()
    moved = {k for k, v in result.weights.items() if not torch.equal(v, initial[k])}
    assert any(vision in k and ".blocks." in k or ".layers." in k and vision in k for k in moved), sorted(moved)[:5]
    layer_tensors = {k for k in initial if (".layers." in k or ".blocks." in k) and k in result.weights}
    assert layer_tensors <= moved, sorted(layer_tensors - moved)[:5]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_rank_fsdp_equals_one_process(family_run: Callable[[str], FamilyRun], name: str) -> None:
    """Qwen2-VL (mRoPE, vision blocks), Gemma 3 (bidirectional image blocks, SigLIP tower), Qwen3.5 (gated
    delta nets): per-step losses, global grad norms and final weights of 2-rank FSDP2 with activation
    checkpointing equal one process on the same packs."""
    run = family_run(name)
    spec = run.spec()
    assert [vision_calls(b) for b in spec.steps[1][0]] == [0, 0]  # rank 0 sees no image in step 2
    sharded = run_ranks(spec)
    assert_same_run(sharded, run.alone, spec)
    assert_sharded(sharded, run.alone, shards=2)
    assert_trained(sharded, run.model_dir, FAMILIES[name])


@pytest.mark.parametrize(
    ("sharding", "node_size", "cpu_offload"),
    [("hybrid", 1, False), ("full", None, True)],
    ids=["hybrid-2-replicas-x-1-shard", "full-cpu-offload"],
)
def test_hybrid_and_offload_equal_one_process(
    family_run: Callable[[str], FamilyRun], sharding: str, node_size: int | None, cpu_offload: bool
) -> None:
    """--sharding hybrid with a node size of 1 (a 2 replicas x 1 shard mesh: gradients reduce-scattered in
    the node, then all-reduced, summed, across the replicas), and --cpu-offload (shards, gradients and
    optimizer state in host memory), each equal one process."""
    run = family_run("qwen2_vl")
    spec = run.spec(sharding=sharding, node_size=node_size, cpu_offload=cpu_offload)
    result = run_ranks(spec)
    assert_same_run(result, run.alone, spec)
    if sharding == "hybrid":  # one shard per node: each replica holds everything
        assert result.local_numel == run.alone.local_numel
    else:
        assert_sharded(result, run.alone, shards=2)


def _losses_and_grads(model: nn.Module, batches: list[PackedBatch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    for batch in batches:
        summed, _ = chunked_token_loss_sum(model, batch)
        summed.backward()
        losses.append(float(summed.detach()))
    return losses, grads_of(model)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_activation_checkpointing_recomputes_every_layer_and_keeps_losses_and_grads(
    family_run: Callable[[str], FamilyRun], name: str, tmp_path: Path
) -> None:
    """One process, fp32, packed keywords (cu_seqlens, image blocks, gated-delta-net boundaries) and the
    chunked loss: checkpointed layers run twice (forward + recompute) and give the same losses and
    gradients. Recomputation repeats the same fp32 operations on the same inputs; only the order in
    which a shared parameter's gradient contributions are summed may change (a few ulps, 1e-6)."""
    run = family_run(name)
    batches = [run.batches[k] for k in ("img", "txt", "img2")]
    results, calls = [], []
    for checkpointing in (False, True):
        model = tiny_model(make_family(name, tmp_path / str(checkpointing)))
        if checkpointing:
            enable_activation_checkpointing(model)
        # the first child of each layer: transformers checkpoints `forward`, so the layer's own hooks
        # run once, its children's again in the recompute
        firsts = [next(layer.children()) for layer in layer_modules(model)]
        counts = Counter[int]()
        for first in firsts:
            first.register_forward_hook(lambda module, args, out, seen=counts: seen.update([id(module)]))
        results.append(_losses_and_grads(model, batches))
        calls.append([counts[id(first)] for first in firsts])
    (plain_losses, plain_grads), (ac_losses, ac_grads) = results
    assert all(n > 0 for n in calls[0]) and calls[1] == [2 * n for n in calls[0]]
    assert ac_losses == pytest.approx(plain_losses, rel=1e-6)
    assert max_grad_error(ac_grads, plain_grads) <= 1e-6


def _ctx(device: str = "cpu", world_size: int = 2) -> DistContext:
    return DistContext(rank=0, world_size=world_size, local_rank=0, device=torch.device(device))


def test_plan_defaults_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_plan(_ctx(world_size=1)).sharding == "none"
    plan = resolve_plan(_ctx(world_size=2))
    assert (plan.sharding, plan.activation_checkpointing, plan.mixed_precision) == ("full", False, False)
    gpu = resolve_plan(_ctx("cuda"), sharding="hybrid")
    assert (gpu.activation_checkpointing, gpu.mixed_precision, gpu.node_size) == (True, True, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ShardingError, match="whole nodes"):
        resolve_plan(_ctx(world_size=4), sharding="hybrid")
    with pytest.raises(ShardingError, match="--cpu-offload"):
        resolve_plan(_ctx(), sharding="none", cpu_offload=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_decoder_layer_and_vision_block_is_a_unit(tmp_path: Path, name: str) -> None:
    model = tiny_model(make_family(name, tmp_path))
    units = [n for n, m in model.named_modules() if any(m is layer for layer in layer_modules(model))]
    config = model.config
    vision_depth = getattr(config.vision_config, "depth", None) or config.vision_config.num_hidden_layers
    text_depth = config.get_text_config().num_hidden_layers
    assert len(units) == vision_depth + text_depth
    assert sum(FAMILIES[name] in n for n in units) == vision_depth
    zero_image(model)  # every family here has a zero image for its tower


def test_a_tower_without_a_known_zero_image_is_refused() -> None:
    """Refused when sharding starts, naming the way out, rather than failing on the first text-only batch."""

    def vision_config(**fields: object) -> object:
        return type("Config", (), {"vision_config": type("VisionConfig", (), fields)()})()

    class NoShape(nn.Module):
        config = vision_config()

        def get_image_features(self, pixel_values: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return pixel_values

    class NeedsSizes(NoShape):  # LLaVA-NeXT, Pixtral: image sizes come with the pixels
        config = vision_config(image_size=32, num_channels=3)

        def get_image_features(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return pixel_values

    class Fixed(NoShape):
        config = vision_config(image_size=32, num_channels=3)

    with pytest.raises(UnsupportedVisionTowerError, match="neither a Qwen-VL patch layout.*--sharding none"):
        zero_image(NoShape())
    with pytest.raises(UnsupportedVisionTowerError, match="also needs image_sizes"):
        zero_image(NeedsSizes())
    assert zero_image(Fixed())["pixel_values"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("name", ["qwen2_vl", "gemma3"])
def test_lora_under_fsdp_equals_one_process(family_run: Callable[[str], FamilyRun], name: str) -> None:
    """--lora-rank with --sharding full: peft wraps before fully_shard, the frozen base weights are sharded, the
    adapters train. Qwen2-VL's config-only directory loads through rank 0 (peft wraps its copy too), Gemma 3's
    saved weights through each rank's own slices (peft's ``base_layer`` names mapped back to the file's keys).
    Losses, global grad norms and adapters equal one process (float64, TIGHT); every base weight is bit-identical
    to the loaded one after training, in both runs."""
    run = family_run(name)
    spec = run.spec(lora_rank=4, max_grad_norm=1e-4)  # small enough that clipping takes part
    alone = run_alone(spec)
    sharded = run_ranks(spec)
    assert_same_run(sharded, alone, spec)
    assert_sharded(sharded, alone, shards=2)  # the adapters (rank-4 rows) are sharded too
    initial = load_model(run.model_dir, seed=0, dtype=torch.float64, attn_implementation="packvlm_varlen").state_dict()
    adapters = {k for k in sharded.weights if ".lora_A." in k or ".lora_B." in k}
    assert adapters and all(".language_model." in k for k in adapters)
    assert all(sharded.weights[k].abs().max() > 0 for k in adapters if ".lora_B." in k)  # B left zero: it trained
    base = {k.replace(".base_layer.", "."): v for k, v in sharded.weights.items() if k not in adapters}
    assert base.keys() == initial.keys()
    for key, tensor in initial.items():
        assert torch.equal(base[key], tensor), key
