"""Peak memory per rank of `train hf` on CPU (gloo) by sharding mode, beside `train hf --plan`'s estimate.

    python benchmarks/bench_train_sharding.py                       # 1, 2 and 4 ranks, every mode
    python benchmarks/bench_train_sharding.py --ranks 1 --modes none
    python benchmarks/bench_train_sharding.py --runs 1:none 2:full 2:full+ac 2:offload 4:full 4:full+ac

Model: a Qwen2-VL config scaled to ~110M parameters (text: 12 layers, hidden 768, MLP 2048,
12 heads / 4 KV heads; vision: 8 blocks of 512; the example's 3,014-token vocabulary), random
init saved as safetensors (sharded runs read each rank's slices of it), fp32. Data: the
example's image/text rows (`prep example`), tokenized and packed at
``--pack-size`` (default 1024: four ranks' activations fit a 24 GiB machine), one pack per
micro-batch. Each configuration is one ``torchrun --nproc_per_node R`` of ``train hf`` with
``--num-workers 0`` (all loader memory in the measured process) and ``--no-final-checkpoint``
(the export after the last step is not the training step being measured) for ``--steps``
steps, at least 2: the first step's forward and backward run before AdamW has made its state,
so only from the second step on does the peak hold everything the plan counts:

    none        every rank holds the whole model, its gradients and AdamW state (`train hf` today)
    full        FSDP2 over all ranks (``--sharding full``)
    full+ac     the same with ``--activation-checkpointing``
    offload     ``--sharding full --cpu-offload``

Modes whose flags `train hf` does not have on this branch are reported as "not available on
this branch" instead of run. Per rank, measured: ``state`` — the bytes of the parameters (local
shards), gradients and AdamW moments the optimizer holds right after its step (an optimizer
step hook: exact, no allocator noise), and ``peak`` — the rise of the peak RSS (``getrusage``)
over the RSS just before `train hf` starts (the model, data, activations, allocator). Beside
them: the plan for the same run (`train.plan`, fp32, the run's largest vision-patch count per
micro-batch) — its state (parameters + gradients + optimizer) and its total — and the ratios
state / (1-rank state / R) and measured peak / plan total; last, the peak rise through the first
step alone (before AdamW's state exists: what a 1-step run would have measured). Prints the
machine first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import transformers
from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MODES = {  # mode -> extra `train hf` flags
    "none": ("--sharding", "none"),
    "full": ("--sharding", "full"),
    "full+ac": ("--sharding", "full", "--activation-checkpointing"),
    "offload": ("--sharding", "full", "--cpu-offload"),
}
SCALED = {  # Qwen2-VL, ~110M parameters with the example's tokenizer
    "text_config": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "layer_types": ["full_attention"] * 12,
    },
    "vision_config": {"depth": 8, "embed_dim": 512, "num_heads": 8, "mlp_ratio": 4, "hidden_size": 768},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMeasure:
    rank: int
    state_bytes: int  # parameters (local shards) + gradients + AdamW moments after the step
    peak_rise_bytes: int  # peak RSS minus the RSS before `train hf` started
    vision_patches: int  # most image patches in one of this rank's micro-batches
    first_step_rise_bytes: int  # the peak RSS rise through the first optimizer step only


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(args, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def prepare(work: Path, pack_size: int) -> tuple[Path, Path, Path]:
    """(packed data, model dir, processor dir): the example's image rows and the scaled Qwen2-VL config."""
    example, packed = work / "example", work / "packed"
    run_cli("prep", "example", str(example))
    run_cli(
        "prep", "tokenize", "--dataset-config", str(example / "dataset_info.json"), "--processor",
        str(example / "processor"), "--dataset", "sharegpt_json", "--output", str(work / "tok"),
        "--max-error-rate", "0.25",
    )  # fmt: skip
    run_cli(
        "prep", "pack", str(work / "tok"), "--output", str(packed), "--pack-size", str(pack_size),
        "--oversize", "drop", "--max-oversize-rate", "1.0",  # samples longer than a small pack: dropped
    )  # fmt: skip
    run_cli("prep", "energon-index", str(packed))
    config = json.loads((example / "model" / "config.json").read_text())
    for part, values in SCALED.items():
        config[part].update(values)
    config["text_config"]["rope_parameters"]["mrope_section"] = [16, 8, 8]  # head_dim 64: t/h/w halves sum to 32
    model = work / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    from train.models import load_model

    # weights on disk: sharded runs then read each rank's slices of them (train.shard_loading), as a real
    # checkpoint is read, rather than drawing the whole random init on rank 0
    load_model(model, seed=0, attn_implementation="sdpa").save_pretrained(model)
    return packed, model, example / "processor"


def supported_flags() -> set[str]:
    from train.recipes.hf import hf_command

    return {opt for param in hf_command.params for opt in param.opts}


def worker(out_dir: Path, train_args: list[str]) -> None:
    """One rank under torchrun: `train hf`, then this rank's measures as JSON."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train.cli import main

    state = {"bytes": 0, "first_peak": 0}

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    def after_step(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)
        moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
        state["bytes"] = max(state["bytes"], total + sum(local_bytes(m) for m in moments))
        if not state["first_peak"]:  # after the first step: everything before AdamW's state existed
            state["first_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    register_optimizer_step_post_hook(after_step)
    before = psutil.Process().memory_info().rss
    main(["hf", *train_args], standalone_mode=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = int(os.environ.get("RANK", "0"))
    metrics = [
        json.loads(line) for line in (Path(train_args[train_args.index("--output") + 1]) / "metrics.jsonl").open()
    ]
    patches = max(m["vision_patches"][rank] for m in metrics)
    measure = RankMeasure(
        rank=rank,
        state_bytes=state["bytes"],
        peak_rise_bytes=peak - before,
        vision_patches=patches,
        first_step_rise_bytes=state["first_peak"] - before,
    )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(dataclasses.asdict(measure)))


def measure(ranks: int, mode: str, inputs: tuple[Path, Path, Path], work: Path, steps: int) -> list[RankMeasure]:
    packed, model, processor = inputs
    out = work / f"run-{ranks}-{mode}"
    measures = work / f"measures-{ranks}-{mode}"
    measures.mkdir()
    train_args = [
        "--data", str(packed), "--model", str(model), "--processor", str(processor), "--output", str(out),
        "--max-steps", str(steps), "--num-workers", "0", "--device", "cpu", "--no-final-checkpoint", *MODES[mode],
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
        str(free_port()), __file__, "--worker", str(measures), "--", *train_args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks {mode} failed:\n{done.stderr[-4000:]}")
    return [RankMeasure(**json.loads((measures / f"rank{r}.json").read_text())) for r in range(ranks)]


def plan_for(ranks: int, mode: str, model: Path, pack_size: int, patches: int) -> tuple[int, int]:
    """(state, total) bytes per rank that `train.plan` gives for this run (fp32 on CPU)."""
    from transformers import AutoConfig

    from train.plan import PlanInputs, model_shape, plan_memory

    shape = model_shape(AutoConfig.from_pretrained(model))
    inputs = PlanInputs(
        world_size=ranks,
        sharding="none" if mode == "none" else "full",
        precision="fp32",
        tokens_per_microbatch=pack_size,
        activation_checkpointing=mode == "full+ac",
        cpu_offload=mode == "offload",
        foreach_optimizer=False,  # torch's AdamW on CPU tensors: the per-tensor loop
        vision_patches=patches,
    )
    plan = plan_memory(shape, inputs)
    # what the optimizer holds after its step, wherever it lives (the reduced unit's gradient is gone by then)
    resident = plan_memory(shape, dataclasses.replace(inputs, cpu_offload=False))
    state = resident.parameters + resident.gradients - resident.transient_gradients + resident.optimizer
    return state, plan.total + plan.host  # offload on CPU: host memory is the same process's memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=2, help="at least 2 (the first step has no AdamW state yet)")
    parser.add_argument("--pack-size", type=int, default=1024)
    parser.add_argument(
        "--runs", nargs="+", help="RANKS:MODE pairs (e.g. 1:none 2:full 4:full) instead of every --ranks x --modes"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: AdamW's state exists from the second step's forward on")
    if args.worker is not None:
        worker(args.worker, [a for a in rest if a != "--"])
        return
    memory = psutil.virtual_memory().total / GIB
    versions = f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {memory:.0f} GiB, {versions}", flush=True)
    flags = supported_flags()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = prepare(work, args.pack_size)
        single: int | None = None
        print(f"{'ranks':>5} {'mode':<8} {'state GiB':>10} {'vs 1-rank/R':>11} {'plan state':>10} "
              f"{'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>9} {'step-1 peak':>11}", flush=True)  # fmt: skip
        runs = [(r, m) for r in args.ranks for m in args.modes]
        if args.runs:
            runs = [(int(r), m) for r, m in (run.split(":") for run in args.runs)]
        for ranks, mode in runs:
            missing = [f for f in MODES[mode] if f.startswith("--") and f not in flags]
            if missing:
                print(f"{ranks:>5} {mode:<8} not available on this branch (train hf has no {', '.join(missing)})")
                continue
            measured = measure(ranks, mode, inputs, work, args.steps)
            state = max(m.state_bytes for m in measured)
            peak = max(m.peak_rise_bytes for m in measured)
            patches = max(m.vision_patches for m in measured)
            first = max(m.first_step_rise_bytes for m in measured)
            plan_state, plan_total = plan_for(ranks, mode, inputs[1], args.pack_size, patches)
            if ranks == 1 and mode == "none":
                single = state
            ideal = f"{state / (single / ranks):11.3f}" if single else f"{'-':>11}"
            print(f"{ranks:>5} {mode:<8} {state / GIB:10.3f} {ideal} {plan_state / GIB:10.3f} {peak / GIB:9.3f} "
                  f"{plan_total / GIB:9.3f} {peak / plan_total:9.3f} {first / GIB:11.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
