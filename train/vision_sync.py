"""Every rank runs the vision tower equally often per micro-batch: FSDP2's collectives line up.

Under FSDP2 each vision block all-gathers its parameters when it runs and reduce-scatters its
gradient in backward: collectives every rank must join, in the same order. A rank whose
micro-batch is text-only never calls the tower while its peer, with images, does: the peer
would wait forever in the block's all-gather (or pair it with the wrong collective). So, once
per optimizer step, the ranks agree (one all-reduce MAX) on how many tower calls each
micro-batch makes, and a rank that makes fewer runs the tower on an all-zero image that
many extra times::

    micro-batch k      rank 0: images + video (2 calls)   rank 1: text only (0 calls)
    agreed             2 calls                             -> rank 1 adds 2 zero-image calls

The extra calls run from a forward hook on the input embeddings, i.e. inside the root's
forward where the model itself calls the tower (after embedding, before the decoder), and join
the graph as ``0 * sum(features)`` added to the embeddings: their gradients are exactly zero
and the loss is unchanged. Order: in forward they precede the decoder layers, as real calls
do; in backward autograd runs nodes in reverse creation order, so their blocks reduce after
every decoder layer's, as real calls' blocks do.

The zero image takes the family's smallest valid shape: a ``merge x merge`` patch grid for the
Qwen-VL tower layout (``temporal_patch_size`` / ``spatial_merge_size``), one full-size image
for fixed-size towers (``image_size``: SigLIP, CLIP). A sharded model whose tower fits neither
is refused when sharding starts, not when the first text-only batch hangs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from packvlm.errors import UsageError
from train.attention import vision_towers
from train.batch import PackedBatch
from train.distributed import DistContext

#: the vision keywords whose presence makes the model call its tower once each
TOWER_INPUTS = ("pixel_values", "pixel_values_videos")


class UnsupportedVisionTowerError(UsageError):
    """The tower of this model cannot be run on a zero image, so it cannot be sharded."""


def vision_calls(batch: PackedBatch) -> int:
    """How many times the model calls its vision tower on ``batch`` (images once, videos once)."""
    return sum(name in batch.vision for name in TOWER_INPUTS)


def _refuse(model: nn.Module, why: str) -> UnsupportedVisionTowerError:
    return UnsupportedVisionTowerError(
        f"{type(model).__name__}: {why}; FSDP needs a zero image for its vision tower on text-only micro-batches: "
        "train it with --sharding none"
    )


def _image_features(model: nn.Module) -> Callable[..., Any]:
    """``model.get_image_features``, refused when it needs more than pixels (and a Qwen-VL grid)."""
    features = getattr(model, "get_image_features", None)
    if not callable(features):
        raise _refuse(model, "no get_image_features")
    required = [
        name
        for name, parameter in inspect.signature(features).parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and name not in ("pixel_values", "image_grid_thw")
    ]
    if required:
        raise _refuse(model, f"get_image_features also needs {', '.join(required)}")
    return features


def zero_image(model: nn.Module) -> dict[str, torch.Tensor]:
    """The smallest all-zero image ``get_image_features`` accepts (see the module docstring)."""
    _image_features(model)
    config = getattr(getattr(model, "config", None), "vision_config", None)
    channels = next((getattr(config, k) for k in ("in_channels", "in_chans", "num_channels") if hasattr(config, k)), 3)
    layout = ("spatial_merge_size", "temporal_patch_size", "patch_size")
    merge, temporal, patch = (getattr(config, k, None) for k in layout)
    if merge and temporal and patch:
        pixels = torch.zeros(merge * merge, channels * temporal * patch * patch)
        return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, merge, merge]])}
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return {"pixel_values": torch.zeros(1, channels, size, size)}
    raise _refuse(model, "its vision config has neither a Qwen-VL patch layout nor a fixed image_size")


def _feature_sum(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in a model output (ModelOutput, tuple, tensor), in fp32."""
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.is_floating_point() else output.new_zeros((), dtype=torch.float32)
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    parts = [_feature_sum(v) for v in values]
    return torch.stack(parts).sum() if parts else torch.zeros(())


class VisionSync:
    """Pads each rank's tower calls to the micro-batch's maximum over ranks (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = bool(vision_towers(model))
        self.pending = 0
        if self.enabled:
            self.inputs = zero_image(model)
            model.get_input_embeddings().register_forward_hook(self._pad_calls)  # type: ignore[operator]

    def agree(self, micro: Sequence[PackedBatch], ctx: DistContext) -> list[int]:
        """Extra tower calls per micro-batch for this rank; every rank calls it once per step."""
        calls = torch.tensor([vision_calls(b) for b in micro], dtype=torch.int64)
        if not self.enabled or not ctx.is_distributed:
            return [0] * len(micro)
        most = calls.to(ctx.device, copy=True)  # a copy: all_reduce writes in place
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return (most.cpu() - calls).tolist()

    @contextlib.contextmanager
    def padded(self, extra_calls: int) -> Iterator[None]:
        """Run ``extra_calls`` zero-image tower calls in the next forward inside this block."""
        self.pending = extra_calls
        try:
            yield
        finally:
            self.pending = 0

    def _pad_calls(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not self.pending:
            return output
        count, self.pending = self.pending, 0
        features = _image_features(self.model)
        inputs = {k: v.to(output.device) for k, v in self.inputs.items()}
        total = torch.stack([_feature_sum(features(**inputs)) for _ in range(count)]).sum()
        return output + (0.0 * total).to(output.dtype)
