"""Sharded loading (`train.shard_loading`): each rank reads only its slices, and gets from_pretrained's weights.

Truth: ``from_pretrained`` of the same directory in one process (`train.models.load_model`, fp32),
compared bit for bit (a slice copied and cast is the same bits as the whole tensor cast). The
checkpoints are written by ``save_pretrained``, so their keys are the saved names transformers
renames on loading (Qwen2-VL ``model.layers.*`` / ``visual.*``, Gemma 3
``language_model.model.*`` / ``vision_tower.*``), Qwen2-VL split into several files with an index,
Gemma 3 in bf16 (cast to fp32 on loading) with its head tied to the embeddings.

Bytes: every ``safe_open`` handle of each rank counts the tensor bytes it returns. FSDP2 gives rank
r the r-th ``torch.chunk`` of each tensor's rows, so rank r must read exactly the sum of those
chunks' bytes, and the ranks together exactly the checkpoint once: no rank reads the whole model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.train.models import make_family
from tests.train.sharded_run import load_ranks
from train.models import build_model, load_model
from train.shard_loading import checkpoint_key_map, checkpoint_keys, safetensors_files, uncovered

SAVED = {  # family: (dtype written, save_pretrained's max_shard_size)
    "qwen2_vl": (torch.float32, "200KB"),
    "gemma3": (torch.bfloat16, "50MB"),
}


def _saved(name: str, root: Path) -> Path:
    dtype, shard_size = SAVED[name]
    model = load_model(make_family(name, root).model_dir, seed=0, attn_implementation="packvlm_varlen")
    with torch.no_grad():  # Gemma 3's projector starts at zero: draw it so a wrong copy shows
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.02)
    model.to(dtype).save_pretrained(root / "weights", max_shard_size=shard_size)
    return root / "weights"


def _rank_bytes(files: list[Path], world_size: int) -> list[int]:
    """Bytes of each rank's dim-0 chunk (torch.chunk, FSDP2's split) of every tensor in ``files``."""
    per_rank = [0] * world_size
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                rows = tensor.reshape(tensor.shape[0] if tensor.dim() else 1, -1)
                for rank, chunk in enumerate(rows.chunk(world_size)):
                    per_rank[rank] += chunk.numel() * chunk.element_size()
    return per_rank


@pytest.mark.parametrize("name", list(SAVED))
def test_each_rank_reads_its_share_and_gets_from_pretrained_weights(name: str, tmp_path: Path) -> None:
    weights = _saved(name, tmp_path)
    files = safetensors_files(weights)
    assert len(files) > 1 if name == "qwen2_vl" else len(files) == 1
    truth = load_model(weights, seed=0, attn_implementation="packvlm_varlen")
    result = load_ranks(weights, world_size=2)

    expected_state = truth.state_dict()
    assert result.state.keys() == expected_state.keys()
    for key, tensor in expected_state.items():
        assert result.state[key].dtype == torch.float32
        assert torch.equal(result.state[key], tensor), key
    buffers = dict(truth.named_buffers())
    assert result.buffers.keys() == buffers.keys() and buffers
    for key, tensor in buffers.items():
        assert torch.equal(result.buffers[key], tensor), key

    share = _rank_bytes(files, 2)
    whole = sum(share)
    assert result.bytes_read == share  # exactly its slices: nothing read twice, nothing whole
    assert max(result.bytes_read) < 0.6 * whole


def test_a_checkpoint_that_needs_more_than_renames_is_left_to_rank_0(tmp_path: Path) -> None:
    """A tensor of another shape, or a parameter the files lack, is a reason: `train.sharding` then loads on
    rank 0 and broadcasts (the path every other test of a config-only directory takes)."""
    weights = _saved("qwen2_vl", tmp_path)
    with torch.device("meta"):
        model = build_model(weights, attn_implementation="packvlm_varlen")
    keys = checkpoint_keys(safetensors_files(weights))
    key_map = checkpoint_key_map(model, keys)
    assert isinstance(key_map, dict) and uncovered(model, key_map) is None
    assert key_map["model.language_model.layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"
    assert key_map["model.visual.patch_embed.proj.weight"] == "visual.patch_embed.proj.weight"

    dropped = dict(key_map)
    del dropped["model.language_model.norm.weight"]
    assert uncovered(model, dropped) == "the checkpoint has no tensor for model.language_model.norm.weight"
    reshaped = keys | {"model.norm.weight": torch.Size([3])}
    assert "has shape (3,)" in str(checkpoint_key_map(model, reshaped))
