"""With LoRA adapters (`train.lora`) a packed row still trains as each of its samples alone.

Per family with a different packed rule (Qwen2-VL: mRoPE, plain causal; Gemma 3: bidirectional
image blocks; Qwen3.5: gated delta nets), the tiny model gets rank-4 adapters on every decoder
linear layer with ``lora_B`` redrawn from N(0, 0.5) (peft starts it at zero, where ``lora_A``
would get no gradient at all and the adapters would change nothing), then the truth is taken:
each sample alone through stock attention (`tests.train.packed_truth`). Claims: per-token
losses within `TOLERANCE` (fp32, as the family tests), gradients exactly on the adapter
weights (none on any base weight) and within `TOLERANCE` relative, and the adapters are live
(the logits move when they are switched off).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from tests.train.families.test_gemma3 import PACKS as GEMMA3_PACKS
from tests.train.families.test_gemma3 import nonzero_projector
from tests.train.families.test_qwen3_5 import own_reference, prepare_long_memory
from tests.train.models import CONVERSATIONS, grads_of, max_grad_error
from tests.train.packed_truth import TOLERANCE, Setup, build_setup, loss_diff
from train.forward import packed_forward
from train.lora import LoraSettings, apply_lora, is_adapter_parameter
from train.loss import per_token_losses, token_loss_sum

pytest.importorskip("peft", reason="LoRA needs peft (the dev and lora extras install it)")

RANK = 4


def with_live_adapters(model: PreTrainedModel) -> None:
    """Rank-4 adapters on every decoder linear layer, lora_B drawn non-zero."""
    apply_lora(model, LoraSettings(rank=RANK))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.5, generator=generator)


def gemma3(model: PreTrainedModel) -> None:
    nonzero_projector(model)
    with_live_adapters(model)


def qwen3_5(model: PreTrainedModel) -> None:
    prepare_long_memory(model)
    with_live_adapters(model)


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3", "qwen3_5"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return build_setup("gemma3", root, GEMMA3_PACKS, vision="vision_tower", prepare=gemma3)
    if request.param == "qwen3_5":
        return build_setup("qwen3_5", root, {"A": CONVERSATIONS}, vision="visual", prepare=qwen3_5, truth=own_reference)
    return build_setup("qwen2_vl", root, {"A": CONVERSATIONS}, vision="visual", prepare=with_live_adapters)


def test_packed_with_lora_equals_samples_alone(setup: Setup) -> None:
    model = setup.model
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(is_adapter_parameter(n) for n in adapters)
    batch = setup.encode("A")
    model.zero_grad(set_to_none=True)
    logits = packed_forward(model, batch)
    assert loss_diff(setup.truth["A"], batch, per_token_losses(logits, batch.labels)) <= TOLERANCE
    token_loss_sum(logits, batch.labels)[0].backward()
    packed = grads_of(model)
    model.zero_grad(set_to_none=True)
    assert packed.keys() == setup.truth["A"].grads.keys() == adapters  # no gradient on a base weight
    assert max_grad_error(packed, setup.truth["A"].grads) <= TOLERANCE
    assert all(float(g.abs().max()) > 0 for n, g in packed.items() if ".lora_A." in n)


@torch.no_grad()
def test_the_adapters_are_live(setup: Setup) -> None:
    from peft.tuners.lora import LoraLayer

    batch = setup.encode("A")
    with_adapters = packed_forward(setup.model, batch)
    layers = [m for m in setup.model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        without = packed_forward(setup.model, batch)
    finally:
        for layer in layers:
            layer.enable_adapters(True)
    assert float((with_adapters - without).abs().max()) > 1e-2
