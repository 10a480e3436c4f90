"""LFM2's short convolutions on packed rows, at the layer level (no torchvision: no processor involved).

``Lfm2ShortConv`` (LFM2, LFM2-VL) and ``Lfm2MoeShortConv`` (LFM2-MoE) run a causal depthwise conv of
``conv_L_cache`` taps through the module-level ``causal_conv1d_fn``, which `train.linear_attention`
hooks: with the row's ``cu_seq_lens_q`` each segment's conv starts from zeros. Truth: each segment
through the same layer alone. Mutation: the unhooked call on the whole row.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from train import linear_attention
from train.linear_attention import UnsupportedLinearAttentionError, install_packed_linear_attention


@pytest.mark.parametrize("model_type", ["lfm2", "lfm2_moe"])
def test_short_conv_layer_packed_equals_each_segment_alone(model_type: str) -> None:
    """Layer level, both LFM2 short-conv classes: the hooked layer on a packed row with ``cu_seq_lens_q``
    equals each segment alone (bit for bit: the same torch conv per slot); the unhooked function leaks."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    config = AutoConfig.for_model(
        model_type, hidden_size=16, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3, vocab_size=32
    )
    torch.manual_seed(0)
    model = MODEL_MAPPING[type(config)](config)
    layer = model.layers[0].conv
    assert type(layer).__name__ in linear_attention.COVERED_LAYERS
    with torch.no_grad():  # outputs of order 1 (the init's std 0.02 gives ~1e-6)
        for weight in (layer.conv.weight, layer.in_proj.weight, layer.out_proj.weight):
            weight.normal_(0.0, 0.5)
    install_packed_linear_attention(model)
    x = torch.randn(1, 11, 16)
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    with torch.no_grad():
        packed = layer(x, cu_seq_lens_q=cu)
        alone = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        whole = layer(x)
    # the same conv per slot; the projections are fp32 sums of 16 terms over rows of other counts
    # (other blocking): ~1e-7 relative, bounded at 1e-5 of the largest output
    scale = float(alone.abs().max())
    assert float((packed - alone).abs().max()) <= 1e-5 * scale
    assert float((whole - alone)[:, 4:6].abs().max()) > 1e-2 * scale  # the first taps of segments 2 and 3
    assert float((whole - alone)[:, :4].abs().max()) <= 1e-5 * scale  # the first segment is the same


def test_uncovered_conv_layer_types_are_refused() -> None:
    """A config declaring ``conv`` layers the model does not hold as covered short convs is refused."""
    model = torch.nn.Module()
    model.config = SimpleNamespace(layer_types=["conv", "full_attention"])
    with pytest.raises(UnsupportedLinearAttentionError, match="1 linear-attention layers in its config, 0 of them"):
        install_packed_linear_attention(model)
