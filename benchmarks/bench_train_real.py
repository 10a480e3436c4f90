"""A real-size training step on one GPU: packed vs padded on the same samples, tokens/s, MFU, peak memory.

    python benchmarks/bench_train_real.py --config benchmarks/configs/qwen2_5_vl_3b --out DIR

The model is built from a published config (default Qwen2.5-VL-3B-Instruct's ``config.json``,
3.75B parameters) with random init on the GPU; no hub, no weights. Each optimizer step is what
`train hf` does on CUDA: fp32 master weights, bf16 autocast, the chunked token-summed loss
(`train.chunked_loss`) over one micro-batch, gradient clipping, AdamW. Activation checkpointing
per decoder layer (transformers' gradient checkpointing, non-reentrant) keeps 8192-token rows
inside 80 GB next to 16 bytes per parameter of weights, gradients and AdamW state.

The data: text-only samples with SFT-like lognormal lengths (median 600, sigma 1.0, clipped to
the pack size; `bench_train_gpu.lognormal_lengths`), random token ids. The vision tower is built
and holds optimizer memory but sees no image (so it gets no gradient): what is timed is the
language model, ~82 % of the parameters. Both paths read the same samples:

    packed   BFD packs of ``--pack-size`` tokens as `PackedBatch` rows, `train.forward` with
             ``packvlm_varlen`` (torch's varlen kernel, or flex_attention with a document mask
             where torch has none; ``--attention flex`` forces the latter)
    padded   the samples in dataset order, a micro-batch = as many rows as fit
             rows x longest <= pack size, each row one sample right-padded to the micro-batch's
             longest, ``attention_mask`` and transformers' SDPA (its default path): the same token
             budget per micro-batch and one optimizer step per micro-batch, as packed

tokens/s counts real (sample) tokens only. MFU = model FLOPs of the real tokens / (seconds x peak):
per token 6 x (matmul parameters of the language model incl. the output head), plus causal
attention 6 x layers x (heads x head_dim) x L per sample of length L (forward 2 L^2 d / 2 per
layer, x3 for the backward); recomputation by checkpointing is not counted (model FLOPs, not
hardware FLOPs). Peak: the dense bf16 tensor-core figure of the card (`PEAK_BF16_TFLOPS`).
Writes ``DIR/bench_train_real.json`` and ``DIR/bench_train_real.md``; prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_gpu import lognormal_lengths, packed_batch, padded_groups, print_machine  # noqa: E402

#: dense bf16 tensor-core peak (no sparsity), NVIDIA data sheets: H100 SXM5 / H200 989.4 TFLOPs,
#: H100 NVL 835, H100 PCIe 756; A100 312
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class PathResult:
    path: str
    micro_batches: int
    real_tokens: int
    computed_tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float
    peak_gib: float
    mean_loss: float


def peak_tflops(name: str) -> float | None:
    return next((value for key, value in PEAK_BF16_TFLOPS if key in name), None)


def model_flops(model: torch.nn.Module, lengths: list[int]) -> float:
    """Training FLOPs (fwd + bwd) of the language model over samples of ``lengths`` (see the docstring)."""
    text = model.config.get_text_config()
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    language = [p for n, p in model.named_parameters() if "visual" not in n and p.dim() >= 2]
    matmul = sum(p.numel() for p in language if p is not embed.weight) + head.weight.numel()
    width = text.num_attention_heads * getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    attention = 6 * text.num_hidden_layers * width * sum(n * n for n in lengths)
    return 6 * matmul * sum(lengths) + attention


def plan(lengths: np.ndarray, pack_size: int, seed: int) -> list[list[int]]:
    """Sample indices per pack: packvlm's BFD planner (`prep.pack.core`), or first-fit decreasing without numba."""
    try:
        from prep.pack.core import plan_packs
    except ImportError:
        packs: list[list[int]] = []
        room: list[int] = []
        for i in np.argsort(-lengths, kind="stable").tolist():
            slot = next((p for p, free in enumerate(room) if free >= lengths[i]), None)
            if slot is None:
                packs.append([]), room.append(pack_size)
                slot = len(packs) - 1
            packs[slot].append(i)
            room[slot] -= int(lengths[i])
        return packs
    assignment = plan_packs(lengths, pack_size=pack_size, seed=seed)
    return [list(assignment.pack(p)) for p in range(assignment.num_packs)]


def build_model(config_dir: Path, attention: str, checkpointing: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from train.attention import prepare_model_for_packing

    config = AutoConfig.from_pretrained(config_dir)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation=attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return prepare_model_for_packing(model).train()


def padded_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The chunked loss of `train.chunked_loss` on a padded batch: head only at label positions."""
    from train.chunked_loss import chunked_cross_entropy_sum, identity_head, label_positions, output_head

    head = output_head(model)
    with identity_head(head.module):
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    h, targets = label_positions(hidden, batch["labels"])
    return chunked_cross_entropy_sum(head, h, targets), int(targets.numel())


def time_path(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_sum: Callable[[Any], tuple[torch.Tensor, int]],
    batches: list[Any],
    warmup: list[Any],
) -> tuple[float, float, list[float]]:
    """Seconds for one `train hf`-like optimizer step per batch after the warmup steps; peak GiB; losses."""
    losses: list[float] = []

    def step(batch: Any) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            summed, count = loss_sum(batch)
        (summed / max(count, 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(summed.detach()) / max(count, 1))

    for batch in warmup:
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30, losses[len(warmup) :]


def force_flex() -> None:
    """Make `train.attention` behave as on a torch without a varlen kernel (flex + document mask)."""
    import train.attention as attention

    attention._varlen_kernel = lambda: None  # type: ignore[assignment]


def attention_path() -> str:
    import train.attention as attention

    return "torch varlen_attn" if attention._varlen_kernel() is not None else "flex_attention + document mask"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from train.attention import select_attention
    from train.chunked_loss import chunked_token_loss_sum

    device = torch.device("cuda", torch.cuda.current_device())
    if args.attention == "flex":
        force_flex()
    rng = np.random.default_rng(args.seed)
    warm_lengths = lognormal_lengths(rng, args.warmup * args.pack_size, args.pack_size)
    lengths = lognormal_lengths(rng, int(args.packs * args.pack_size * 0.99), args.pack_size)
    vocab = 151_000
    samples = [torch.from_numpy(rng.integers(0, vocab, int(n))) for n in lengths]
    warm = [torch.from_numpy(rng.integers(0, vocab, int(n))) for n in warm_lengths]

    attention = select_attention(device)
    model = build_model(args.config, attention, not args.no_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    parameters = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_properties(device).name
    peak = peak_tflops(name)
    results: list[PathResult] = []

    def record(path: str, batches: list[Any], seconds: float, peak_gib: float, losses: list[float], computed: int):
        flops = model_flops(model, [int(n) for n in lengths])
        results.append(
            PathResult(
                path=path,
                micro_batches=len(batches),
                real_tokens=int(lengths.sum()),
                computed_tokens=computed,
                seconds=seconds,
                tokens_per_s=float(lengths.sum()) / seconds,
                mfu=flops / seconds / (peak * 1e12) if peak else float("nan"),
                peak_gib=peak_gib,
                mean_loss=float(np.mean(losses)),
            )
        )
        print(f"  {path}: {results[-1].tokens_per_s:,.0f} real tokens/s, peak {peak_gib:.1f} GiB", flush=True)

    packs = [packed_batch([samples[i] for i in p], device) for p in plan(lengths, args.pack_size, args.seed)]
    warm_packs = [packed_batch([warm[i] for i in p], device) for p in plan(warm_lengths, args.pack_size, args.seed)]
    seconds, peak_gib, losses = time_path(
        model, optimizer, lambda b: chunked_token_loss_sum(model, b, backend="chunked"), packs, warm_packs
    )
    record(
        f"packed ({attention}: {attention_path()})", packs, seconds, peak_gib, losses, sum(b.num_tokens for b in packs)
    )

    if not args.no_padded:
        from bench_train_gpu import padded_batch

        model.set_attn_implementation("sdpa")
        padded = [padded_batch([samples[i] for i in g], device) for g in padded_groups(lengths, args.pack_size)]
        warm_padded = [padded_batch([warm[i] for i in g], device) for g in padded_groups(warm_lengths, args.pack_size)]
        with contextlib.suppress(torch.cuda.OutOfMemoryError):
            seconds, peak_gib, losses = time_path(
                model, optimizer, lambda b: padded_loss_sum(model, b), padded, warm_padded
            )
            computed = sum(int(b["input_ids"].numel()) for b in padded)
            record("padded (sdpa + attention_mask)", padded, seconds, peak_gib, losses, computed)

    report = {
        "device": name,
        "torch": torch.__version__,
        "config": str(args.config),
        "parameters": parameters,
        "pack_size": args.pack_size,
        "activation_checkpointing": not args.no_checkpointing,
        "peak_bf16_tflops": peak,
        "samples": len(lengths),
        "results": [asdict(r) for r in results],
    }
    if len(results) == 2:
        report["packed_over_padded"] = results[0].tokens_per_s / results[1].tokens_per_s
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}, torch {report['torch']}, {Path(report['config']).name} "
        f"({report['parameters'] / 1e9:.2f}B parameters, random init), {report['pack_size']}-token packs, "
        f"{report['samples']} samples, bf16 autocast over fp32 master weights, AdamW, activation checkpointing "
        f"{'on' if report['activation_checkpointing'] else 'off'}; MFU against {report['peak_bf16_tflops']} "
        "TFLOPs dense bf16",
        "",
        "| path | micro-batches | real tokens | real % | seconds | real tokens/s | MFU | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['path']} | {r['micro_batches']} | {r['real_tokens']:,} | "
            f"{100 * r['real_tokens'] / r['computed_tokens']:.1f} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f} % | {r['peak_gib']:.1f} |"
        )
    if "packed_over_padded" in report:
        lines += ["", f"packed / padded real tokens/s: {report['packed_over_padded']:.2f}x"]
    return "\n".join(lines) + "\n"


#: the shape fields of a published config copied onto another family config (vocabulary and token ids kept)
SHAPE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
)  # fmt: skip
VISION_SHAPE_FIELDS = (
    "depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "window_size",
    "fullatt_block_indexes",
)  # fmt: skip


def write_shaped_model(shape_dir: Path, like: Path, out: Path) -> Path:
    """``like``'s config.json (a `prep example` model: its processor's vocabulary and token ids) with the
    layer shapes of ``shape_dir``'s config: a real-size model `train hf` accepts with the example data."""
    shape = json.loads((shape_dir / "config.json").read_text())
    config = json.loads((like / "config.json").read_text())
    text = config.get("text_config", config)
    for key in SHAPE_FIELDS:
        if key in shape:
            text[key] = shape[key]
            config.pop(key, None) if text is not config else None
    text.pop("head_dim", None)
    text.pop("layer_types", None)  # derived again from num_hidden_layers
    for key in VISION_SHAPE_FIELDS:
        if key in shape.get("vision_config", {}):
            config.setdefault("vision_config", {})[key] = shape["vision_config"][key]
    if "rope_scaling" in shape and "rope_parameters" in text:  # transformers 5 spelling
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": shape["rope_scaling"]["mrope_section"]}
        text["rope_parameters"]["rope_theta"] = shape.get("rope_theta", text["rope_parameters"].get("rope_theta"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json",):
        if (like / name).is_file():
            (out / name).write_text((like / name).read_text())
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "shaped-model":  # shaped-model SHAPE_DIR LIKE_DIR OUT
        print(write_shaped_model(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).parent / "configs" / "qwen2_5_vl_3b")
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--packs", type=int, default=6, help="timed packs' worth of samples (same for both paths)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed packs' worth of other samples per path")
    parser.add_argument("--attention", choices=["auto", "flex"], default="auto")
    parser.add_argument("--no-padded", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write bench_train_real.json / .md here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print_machine(None)
        print("No CUDA device: this benchmark measures GPU training and needs one. Nothing run.")
        return
    print_machine(torch.device("cuda", torch.cuda.current_device()))
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_train_real.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "bench_train_real.md").write_text(text)


if __name__ == "__main__":
    main()
