"""The "what fits on 8 x 80 GB" table, from `train.plan` on the published Qwen2.5-VL configs.

    python benchmarks/plan_table.py                      # markdown, 8192-token packs
    python benchmarks/plan_table.py --pack-size 16384 --gpu-memory 141GB

Configs: ``benchmarks/configs/qwen2_5_vl_{7b,32b,72b}/config.json`` (the values of the
published ``Qwen/Qwen2.5-VL-*-Instruct`` configs; no weights). Every row is what
``train hf --plan --plan-world-size 8 --gpu-memory 80GB`` prints for that run: bf16 compute
with fp32 master weights and AdamW, one pack per micro-batch. ``hybrid`` is 2 nodes x 4 GPUs
(shard inside a node of 4, replicate across the 2); ``full`` shards over all 8.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoConfig

from train.plan import GiB, PlanInputs, Sharding, model_shape, parse_memory, plan_memory

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = ("qwen2_5_vl_7b", "qwen2_5_vl_32b", "qwen2_5_vl_72b")
LORA_RANK = 16
#: (label, sharding, gpus per node, activation checkpointing, CPU offload, LoRA rank, frozen groups)
SETUPS: tuple[tuple[str, Sharding, int, bool, bool, int, tuple[str, ...]], ...] = (
    ("no sharding (every GPU holds everything)", "none", 8, True, False, 0, ()),
    ("full sharding", "full", 8, False, False, 0, ()),
    ("full sharding + checkpointing", "full", 8, True, False, 0, ()),
    ("hybrid (2 nodes x 4) + checkpointing", "hybrid", 4, True, False, 0, ()),
    ("full + checkpointing, vision frozen", "full", 8, True, False, 0, ("vision",)),
    ("full + checkpointing + CPU offload", "full", 8, True, True, 0, ()),
    (f"LoRA r{LORA_RANK}, no sharding + checkpointing", "none", 8, True, False, LORA_RANK, ()),
    (f"LoRA r{LORA_RANK}, full sharding + checkpointing", "full", 8, True, False, LORA_RANK, ()),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-memory", default="80GB")
    args = parser.parse_args()
    memory = parse_memory(args.gpu_memory)
    shapes = {}
    for name in MODELS:
        config = AutoConfig.from_pretrained(CONFIGS / name)
        shapes[name] = (model_shape(config), model_shape(config, lora_rank=LORA_RANK))
    header = " | ".join(f"{name.split('_')[-1].upper()} ({shapes[name][0].num_params / 1e9:.1f}B)" for name in MODELS)
    print(f"| {args.gpus} x {args.gpu_memory}, {args.pack_size:,}-token packs | {header} |")
    print("|---|" + "---|" * len(MODELS))
    for label, sharding, per_node, checkpointing, offload, rank, frozen in SETUPS:
        cells = []
        for name in MODELS:
            inputs = PlanInputs(
                world_size=args.gpus,
                gpus_per_node=per_node,
                sharding=sharding,
                freeze=frozen,  # type: ignore[arg-type]
                lora_rank=rank,
                tokens_per_microbatch=args.pack_size,
                activation_checkpointing=checkpointing,
                cpu_offload=offload,
                gpu_memory_bytes=memory,
            )
            plan = plan_memory(shapes[name][1 if rank else 0], inputs)
            host = f" (+{plan.host / GiB:.0f} GiB host)" if plan.host else ""
            cells.append(f"{plan.total / GiB:.1f} GiB{host} {'fits' if plan.fits else '**does not fit**'}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
