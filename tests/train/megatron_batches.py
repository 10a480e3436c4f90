"""Hand-built `PackedBatch` rows and the megatron-core GPU setup shared by the Megatron tests.

`make_batch` builds a row the slow, obvious way (each sample's ids and HF labels, slots padded)
so the tests' expectations never go through the code under test; `megatron_parallel_state`
is megatron-core's parallel state in a one-process NCCL group (tp = pp = 1) for the `gpu` tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from train.batch import IGNORE_INDEX, PackedBatch
from train.megatron.model import is_installed

HAS_MEGATRON = is_installed("megatron.core")
HAS_TE = is_installed("transformer_engine")
HAS_GPU_STACK = torch.cuda.is_available() and HAS_TE and HAS_MEGATRON
PAD = 0
A0, A1, A2, B0, B1 = 11, 12, 13, 21, 22
# The train.batch docstring pack: samples of 3 and 2 tokens, first label of each masked.
DOC_SAMPLES = [([A0, A1, A2], [IGNORE_INDEX, A1, A2]), ([B0, B1], [IGNORE_INDEX, B1])]
GPU_VOCAB = 500


def make_batch(samples: list[tuple[list[int], list[int]]], pad_to_multiple_of: int = 1, *, multimodal=False):
    """A PackedBatch built the slow, obvious way: (input_ids, HF labels) per sample, slots padded."""
    ids, labels, pos, real, padded = [], [], [], [0], [0]
    for tokens, sample_labels in samples:
        slot = -(-len(tokens) // pad_to_multiple_of) * pad_to_multiple_of
        ids += tokens + [PAD] * (slot - len(tokens))
        labels += sample_labels + [IGNORE_INDEX] * (slot - len(tokens))
        pos += list(range(slot))
        real.append(real[-1] + len(tokens))
        padded.append(padded[-1] + slot)
    T = len(ids)
    position_ids = torch.tensor([pos])
    if multimodal:
        position_ids = torch.stack([position_ids, position_ids + 100, position_ids + 200, position_ids + 300])
    return PackedBatch(
        input_ids=torch.tensor([ids]),
        labels=torch.tensor([labels]),
        position_ids=position_ids,
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(padded, padded[1:])),
        mm_token_type_ids=torch.zeros(1, T, dtype=torch.long),
        pack_keys=("pack-00000007",),
        sample_ids=tuple(f"example:{i}:0" for i in range(len(samples))),
    )


def gpu_samples() -> list[tuple[list[int], list[int]]]:
    """Three samples (7, 12, 5 tokens); the second has a 3-token prompt without loss."""
    gen = torch.Generator().manual_seed(7)
    samples = []
    for length, prompt in ((7, 1), (12, 3), (5, 1)):
        tokens = torch.randint(1, GPU_VOCAB, (length,), generator=gen).tolist()
        samples.append((tokens, [IGNORE_INDEX] * prompt + tokens[prompt:]))
    return samples


@contextlib.contextmanager
def megatron_parallel_state(seed: int = 1234, context_parallel_size: int = 1) -> Iterator[None]:
    """megatron-core's parallel state (tp = pp = 1) in this process's NCCL group, torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from train.recipes.megatron import _free_port

    torch.cuda.set_device(0)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=context_parallel_size
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
