"""Peak memory of one packed training step: full-vocabulary logits versus the chunked label loss.

    python benchmarks/bench_train_memory.py --pack-sizes 2048 8192

Same model, same pack, one forward + backward of the summed token loss (no optimizer step),
each configuration in a fresh Python process so no allocator cache or earlier peak carries over:

    full      what `train hf` ran before: `train.forward.packed_forward` -> logits [1, T, V],
              `train.loss.token_loss_sum` (fp32 cross-entropy over every position)
    chunked   what it runs now: `train.chunked_loss.chunked_token_loss_sum` (the output head
              only at label positions, --chunk-size of them at a time, each chunk checkpointed)

Model: the example's tiny Qwen2-VL (`prep example`: 2 text layers, hidden 64) with its
vocabulary widened to 151,936 (Qwen2's), random init, fp32; on CUDA the step runs under bf16
autocast as `train hf` does. Pack: text-only samples of 512 tokens, each opening with a
128-token prompt without labels (75 % label positions), varlen attention. Memory: on CPU the
child's peak RSS (``getrusage``) and its rise over the RSS just before the step; on CUDA
``torch.cuda.max_memory_allocated`` and its rise over the allocation before the step. Prints
the machine, both figures per pack size and the ratio full / chunked. On CPU each child's
address space is capped at 85 % of the memory available when it starts (the machine may be
shared): a configuration that needs more stops there and is reported as such instead of
pushing others' processes out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import transformers
from machine import cpu_model

VOCAB_SIZE = 151_936  # Qwen2 / Qwen2.5 / Qwen2-VL
SAMPLE_TOKENS = 512
PROMPT_TOKENS = 128
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Measure:
    path: str
    pack_size: int
    label_positions: int
    peak_bytes: int  # peak RSS (CPU) or max allocated (CUDA) of the whole process
    step_bytes: int  # that peak minus what the process held just before the step
    seconds: float


def write_model(out_dir: Path) -> Path:
    """The example's tiny Qwen2-VL config with a 152k vocabulary (config only: random init)."""
    from families.example.model import write_model_config
    from families.qwen2_vl.processor_dir import build_processor_dir
    from prep.example.model import tiny_model_config

    config = tiny_model_config("qwen2_vl", build_processor_dir(out_dir / "processor", "qwen2_vl"))
    config.text_config.vocab_size = VOCAB_SIZE
    return write_model_config(config, out_dir / "model")


def make_batch(pack_size: int, device: torch.device) -> object:
    """Text-only samples of SAMPLE_TOKENS filling ``pack_size``; prompts carry no labels."""
    from train.batch import IGNORE_INDEX, PackedBatch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(VOCAB_SIZE // 2, VOCAB_SIZE, (1, pack_size), generator=generator)
    positions = (torch.arange(pack_size) % SAMPLE_TOKENS)[None]
    labels = torch.where(positions < PROMPT_TOKENS, IGNORE_INDEX, input_ids)
    cu = torch.arange(0, pack_size + 1, SAMPLE_TOKENS, dtype=torch.int32)
    batch = PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=positions[None].expand(4, 1, pack_size).contiguous(),  # text row + t/h/w rows
        cu_seqlens=cu,
        cu_seqlens_padded=cu,
        max_seqlen=SAMPLE_TOKENS,
        mm_token_type_ids=torch.zeros_like(input_ids),
    )
    return batch.to(device)


def child(path: str, pack_size: int, model_dir: Path, device_name: str, chunk_size: int, limit_bytes: int) -> None:
    """One configuration in this (fresh) process; prints a `Measure` as one JSON line."""
    if limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    from train.attention import select_attention
    from train.chunked_loss import chunked_token_loss_sum
    from train.forward import packed_forward
    from train.loss import token_loss_sum
    from train.models import load_model

    device = torch.device(device_name)
    model = load_model(model_dir, seed=0, attn_implementation=select_attention(device), device=device).train()
    batch = make_batch(pack_size, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    with autocast:
        if path == "full":
            logits = packed_forward(model, batch)
    if path == "full":
        summed, count = token_loss_sum(logits, batch.labels)
        del logits
    else:
        with autocast:
            summed, count = chunked_token_loss_sum(model, batch, chunk_size=chunk_size)
    summed.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    seconds = time.perf_counter() - started
    measure = Measure(
        path=path,
        pack_size=pack_size,
        label_positions=count,
        peak_bytes=peak,
        step_bytes=peak - before,
        seconds=seconds,
    )
    print(json.dumps({k: getattr(measure, k) for k in Measure.__slots__}))


def measure(path: str, pack_size: int, model_dir: Path, device: str, chunk_size: int) -> Measure | None:
    """Run one configuration in a fresh process; None (with a note) if it hit the memory cap."""
    limit = int(0.85 * psutil.virtual_memory().available) if device == "cpu" else 0
    args = [sys.executable, __file__, "--child", path, "--pack-sizes", str(pack_size), "--model-dir", str(model_dir)]
    args += ["--device", device, "--chunk-size", str(chunk_size), "--limit-bytes", str(limit)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        if "memory" not in last.lower():
            raise SystemExit(f"{path} at {pack_size} failed:\n{out.stderr}")
        print(f"  {path} at {pack_size}: over the {limit / GIB:.1f} GiB cap ({last[:120]})")
        return None
    return Measure(**json.loads(out.stdout.strip().splitlines()[-1]))


def print_machine(device: str) -> None:
    memory = psutil.virtual_memory()
    gpu = f" | {torch.cuda.get_device_name()}" if device == "cuda" else ""
    print(
        f"machine: {platform.platform()} | {cpu_model()} | cpu_count={os.cpu_count()} | "
        f"RAM {memory.total / GIB:.0f} GiB ({memory.available / GIB:.0f} available){gpu} | "
        f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack-sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk-size", type=int, default=None, help="default: train.chunked_loss.DEFAULT_CHUNK_SIZE")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--child", choices=("full", "chunked"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--limit-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from train.chunked_loss import DEFAULT_CHUNK_SIZE

    chunk_size = args.chunk_size or DEFAULT_CHUNK_SIZE
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.child:
        child(args.child, args.pack_sizes[0], args.model_dir, device, chunk_size, args.limit_bytes)
        return
    print_machine(device)
    unit = "max_memory_allocated" if device == "cuda" else "peak RSS"
    precision = "fp32 + bf16 autocast" if device == "cuda" else "fp32"
    print(
        f"tiny Qwen2-VL (2 layers, hidden 64), vocab {VOCAB_SIZE:,}, {precision}, one forward + backward on {device}"
        f"; chunk {chunk_size} label positions; {unit}, fresh process each"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp))
        rows = []
        for pack_size in args.pack_sizes:
            full = measure("full", pack_size, model_dir, device, chunk_size)
            chunked = measure("chunked", pack_size, model_dir, device, chunk_size)
            rows.append((pack_size, full, chunked))
    print(f"\n| pack | label positions | {unit}: full | chunked | ratio | step's rise: full | chunked | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for pack_size, full, chunked in rows:
        if full is None or chunked is None:
            print(f"| {pack_size} | not measured (see above) |")
            continue
        print(
            f"| {pack_size} | {chunked.label_positions} | {full.peak_bytes / MIB:,.0f} MiB | "
            f"{chunked.peak_bytes / MIB:,.0f} MiB | {full.peak_bytes / chunked.peak_bytes:.1f}x | "
            f"{full.step_bytes / MIB:,.0f} MiB | {chunked.step_bytes / MIB:,.0f} MiB | "
            f"{full.step_bytes / max(chunked.step_bytes, 1):.1f}x |"
        )
    print("\nstep seconds (one step, shared machine: indicative only):")
    for pack_size, full, chunked in rows:
        if full is not None and chunked is not None:
            print(f"  {pack_size}: full {full.seconds:.2f} s, chunked {chunked.seconds:.2f} s")


if __name__ == "__main__":
    main()
