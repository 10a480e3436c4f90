"""Benchmark packed varlen training steps against padded batches on one GPU, in one run.

    python benchmarks/bench_train_gpu.py --pack-sizes 4096 8192 --models tiny medium

Same model, same samples, same token budget per micro-batch, forward + backward of the
token-summed loss (no optimizer step: its cost is per micro-batch, not per token):

    packed   our path: BFD packs (`prep.pack.core.plan_packs`) as `PackedBatch` rows,
             `train.forward.packed_forward` with `train.attention.select_attention("cuda")`
             (torch's varlen flash kernel unless flash-attn is installed)
    padded   standard Hugging Face: samples in dataset order, batched while
             batch x longest <= budget, padded to the longest, ``attention_mask``, "sdpa"
    padded, no mask   the same batches without ``attention_mask`` (right padding + causal:
             real tokens never see a pad), so SDPA can use its flash kernel: a stronger
             baseline than what HF runs by default

Lengths: lognormal SFT-like (median 600, sigma 1.0, clipped to [16, budget]). Models:
Qwen2 text configs built from config with random init in bf16 ("tiny" ~40M parameters,
"medium" Qwen2.5-0.5B-shaped ~0.5B). Prints real tokens/s of each, the ratio (target
>= 1.8x), peak memory and the real-token fraction of each path's micro-batches. Without
CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

RATIO_TARGET = 1.8
IGNORE_INDEX = -100

# Qwen2 text configs (random init): name -> Qwen2Config kwargs
MODELS: dict[str, dict[str, int | bool]] = {
    "tiny": {
        "vocab_size": 32_000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "medium": {  # the shape of Qwen2.5-0.5B
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    model: str
    pack_size: int
    path: str
    micro_batches: int
    real_tokens: int
    computed_tokens: int
    seconds: float
    peak_gib: float

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds

    @property
    def real_fraction(self) -> float:
        return self.real_tokens / self.computed_tokens


def lognormal_lengths(rng: np.random.Generator, total_tokens: int, max_len: int) -> np.ndarray:
    """SFT-like lengths (median 600, sigma 1.0) in [16, max_len] until ``total_tokens``."""
    raw = np.exp(rng.normal(np.log(600), 1.0, 4 * total_tokens // 600 + 64))
    lengths = np.clip(raw, 16, max_len).astype(np.int64)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), total_tokens)) + 1]


def padded_groups(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Dataset order, each batch as large as fits ``len(batch) * longest <= budget``."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths.tolist()):
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def packed_batch(samples: list[torch.Tensor], device: torch.device) -> object:
    """A text-only `PackedBatch`: positions restart per sample, each first label masked."""
    from train.batch import PackedBatch

    input_ids = torch.cat(samples)[None]
    labels = input_ids.clone()
    lengths = torch.tensor([s.numel() for s in samples])
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=positions,
        cu_seqlens=cu,
        cu_seqlens_padded=cu.clone(),
        max_seqlen=int(lengths.max()),
        mm_token_type_ids=torch.zeros_like(input_ids),
    ).to(device)


def padded_batch(samples: list[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` (pad labels -100)."""
    longest = max(s.numel() for s in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, s in enumerate(samples):
        input_ids[row, : s.numel()] = s
        mask[row, : s.numel()] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {k: v.to(device) for k, v in {"input_ids": input_ids, "attention_mask": mask, "labels": labels}.items()}


def time_steps(step: Callable[[object], int], batches: list[object], warmup: int) -> tuple[float, float]:
    """Seconds for one step per batch after ``warmup`` untimed steps; peak GiB allocated."""
    for batch in batches[:warmup]:
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def build_model(name: str, attn: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**MODELS[name], max_position_embeddings=32_768, use_cache=False)
    torch.manual_seed(0)
    with device:  # initialise on the GPU: seconds instead of a minute for 0.5B parameters on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model.to(device).train()


def run_case(
    name: str, pack_size: int, total_tokens: int, warmup: int, seed: int, device: torch.device
) -> list[Result]:
    from prep.pack.core import plan_packs
    from train.attention import select_attention
    from train.forward import packed_forward
    from train.loss import token_loss_sum

    rng = np.random.default_rng(seed)
    lengths = lognormal_lengths(rng, total_tokens, pack_size)
    vocab = int(MODELS[name]["vocab_size"])
    samples = [torch.from_numpy(rng.integers(0, vocab, int(n))) for n in lengths]
    plan = plan_packs(lengths, pack_size=pack_size, seed=seed)
    packs = [packed_batch([samples[i] for i in plan.pack(p)], device) for p in range(plan.num_packs)]
    groups = padded_groups(lengths, pack_size)
    padded = [padded_batch([samples[i] for i in g], device) for g in groups]
    real = int(lengths.sum())

    attn = select_attention(device)
    model = build_model(name, attn, device)

    def packed_step(batch: object) -> int:
        loss_sum, count = token_loss_sum(packed_forward(model, batch), batch.labels)
        (loss_sum / max(count, 1)).backward()
        model.zero_grad(set_to_none=True)
        return count

    def padded_step(batch: dict[str, torch.Tensor], masked: bool = True) -> int:
        mask = batch["attention_mask"] if masked else None
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits
        loss_sum, count = token_loss_sum(logits, batch["labels"])
        (loss_sum / max(count, 1)).backward()
        model.zero_grad(set_to_none=True)
        return count

    results = []
    seconds, peak = time_steps(packed_step, packs, warmup)
    computed = sum(b.num_tokens for b in packs)
    results.append(Result(model=name, pack_size=pack_size, path=f"packed ({attn})", micro_batches=len(packs),
                          real_tokens=real, computed_tokens=computed, seconds=seconds, peak_gib=peak))  # fmt: skip
    model.set_attn_implementation("sdpa")
    seconds, peak = time_steps(padded_step, padded, warmup)
    computed = sum(int(b["input_ids"].numel()) for b in padded)
    results.append(Result(model=name, pack_size=pack_size, path="padded (sdpa + mask)", micro_batches=len(padded),
                          real_tokens=real, computed_tokens=computed, seconds=seconds, peak_gib=peak))  # fmt: skip
    # Right padding + causal attention: real tokens never see a pad, so the mask can go and SDPA
    # picks its flash kernel. Not what HF does by default; isolates the cost of the padding itself.
    seconds, peak = time_steps(lambda b: padded_step(b, masked=False), padded, warmup)
    results.append(Result(model=name, pack_size=pack_size, path="padded (sdpa causal, no mask)",
                          micro_batches=len(padded), real_tokens=real, computed_tokens=computed, seconds=seconds,
                          peak_gib=peak))  # fmt: skip
    return results


def print_machine(device: torch.device | None) -> None:
    import transformers

    gpu = "no CUDA device"
    if device is not None:
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    print(
        f"machine: {platform.platform()} | {gpu} | cpu_count={os.cpu_count()} | python {platform.python_version()}"
        f" | torch {torch.__version__} (CUDA {torch.version.cuda}) | transformers {transformers.__version__}"
    )


def check_varlen_api() -> str:
    """The signature of torch's varlen_attn, or why it is unusable here."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return f"MISSING: torch.nn.attention.varlen.varlen_attn ({exc})"
    params = inspect.signature(varlen_attn).parameters
    gqa = "native GQA" if "enable_gqa" in params else "no enable_gqa: train/attention.py repeats the kv heads"
    return f"varlen_attn{inspect.signature(varlen_attn)} ({gqa})"


def print_results(results: Iterable[Result]) -> list[tuple[str, float, float]]:
    rows = list(results)
    print(
        f"  {'model':<8}{'budget':>7}  {'path':<28}{'mbs':>6}{'real tok':>11}{'real %':>8}"
        f"{'seconds':>9}{'real tok/s':>12}{'peak GiB':>10}"
    )
    for r in rows:
        print(
            f"  {r.model:<8}{r.pack_size:>7}  {r.path:<28}{r.micro_batches:>6}{r.real_tokens:>11,}"
            f"{100 * r.real_fraction:>7.1f}%{r.seconds:>9.2f}{r.tokens_per_s:>12,.0f}{r.peak_gib:>10.2f}"
        )
    packed, masked, unmasked = rows
    label = f"{packed.model} budget={packed.pack_size}"
    return [(label, packed.tokens_per_s / masked.tokens_per_s, packed.tokens_per_s / unmasked.tokens_per_s)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=400_000, help="real tokens per case (same for both paths)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed micro-batches per path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print_machine(None)
        print("No CUDA device: this benchmark measures GPU training throughput and needs one. Nothing run.")
        sys.exit(0)
    device = torch.device("cuda", torch.cuda.current_device())
    print_machine(device)
    print(f"torch varlen API: {check_varlen_api()}")
    print(
        f"workload: lognormal lengths (median 600, sigma 1.0), {args.tokens:,} real tokens per case; "
        "bf16 weights, forward + backward, no optimizer step"
    )
    ratios = []
    for name in args.models:
        for pack_size in args.pack_sizes:
            results = run_case(name, pack_size, args.tokens, args.warmup, args.seed, device)
            ratios += print_results(results)
            torch.cuda.empty_cache()  # the case's model and batches are gone with its frame
    print(f"\npacked / padded real tokens/s (target >= {RATIO_TARGET}x against the standard HF padded batch):")
    for label, ratio, unmasked in ratios:
        verdict = "PASS" if ratio >= RATIO_TARGET else "FAIL"
        print(f"  {label:<24} {ratio:5.2f}x -> {verdict}   (vs padded without mask: {unmasked:5.2f}x)")


if __name__ == "__main__":
    main()
