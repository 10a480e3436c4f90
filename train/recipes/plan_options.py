"""``train hf --plan``: the flags, and the run's memory plan printed instead of training (`train.plan`).

The plan takes the run's own options (model, --freeze, --lora-*, --packs-per-microbatch, the
pack size of --data's manifest, --device: cpu plans fp32, otherwise bf16 compute) plus the
world it will run on (``--plan-world-size``, default ``$WORLD_SIZE`` or 1). Sharding, activation
checkpointing and CPU offload come from the run's ``sharding`` / ``activation_checkpointing`` /
``cpu_offload`` options where the recipe has them; without them the plan assumes what
`train hf` will default to: ``full`` sharding over more than one GPU, checkpointing on, no offload.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from schemas.packed import read_packed_output
from train.plan import SHARDINGS, MemoryPlan, PlanInputs, Sharding, model_shape, parse_memory, plan_memory

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """What ``--plan`` adds to the run's options."""

    world_size: int | None = None  # None: $WORLD_SIZE or 1
    gpus_per_node: int = 8
    gpu_memory: str | None = None  # e.g. "80GB"


def plan_options(func: F) -> F:
    """Decorator adding ``--plan``, ``--gpu-memory``, ``--plan-world-size``, ``--plan-gpus-per-node``."""
    defaults = PlanRequest()
    options = [
        click.option(
            "--plan",
            is_flag=True,
            help="Print the per-GPU memory this run needs (parameters, gradients, optimizer, activations) and "
            "exit; reads the model's config only, no weights, no GPU.",
        ),
        click.option("--gpu-memory", default=defaults.gpu_memory, help="With --plan: FITS / DOES NOT FIT, e.g. 80GB."),
        click.option(
            "--plan-world-size",
            type=click.IntRange(min=1),
            default=defaults.world_size,
            help="With --plan: GPUs of the run  [default: $WORLD_SIZE or 1]",
        ),
        click.option(
            "--plan-gpus-per-node",
            type=click.IntRange(min=1),
            default=defaults.gpus_per_node,
            show_default=True,
            help="With --plan: GPUs per node (the shard group of hybrid sharding).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def pop_plan_request(options: dict[str, Any]) -> PlanRequest | None:
    """Take the plan flags out of a command's options; the request when ``--plan`` was given."""
    wanted = options.pop("plan")
    request = PlanRequest(
        world_size=options.pop("plan_world_size"),
        gpus_per_node=options.pop("plan_gpus_per_node"),
        gpu_memory=options.pop("gpu_memory"),
    )
    return request if wanted else None


def plan_inputs(config: Any, request: PlanRequest, pack_size: int) -> PlanInputs:
    """The `PlanInputs` of a `train hf` config on the world ``request`` names."""
    world = request.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    sharding: Sharding = getattr(config, "sharding", None) or ("full" if world > 1 else "none")
    if sharding not in SHARDINGS:  # e.g. an "auto" the recipe resolves itself
        sharding = "full" if world > 1 else "none"
    checkpointing = getattr(config, "activation_checkpointing", None)
    return PlanInputs(
        world_size=world,
        gpus_per_node=request.gpus_per_node,
        sharding=sharding,
        precision="fp32" if config.device == "cpu" else "bf16",
        freeze=tuple(config.freeze),
        lora_rank=config.lora_rank,
        tokens_per_microbatch=pack_size * config.packs_per_microbatch,
        activation_checkpointing=True if checkpointing is None else bool(checkpointing),
        cpu_offload=bool(getattr(config, "cpu_offload", False)),
        foreach_optimizer=config.device != "cpu",  # torch's AdamW: foreach on CUDA, a per-tensor loop on CPU
        gpu_memory_bytes=parse_memory(request.gpu_memory) if request.gpu_memory else None,
    )


def plan_run(config: Any, request: PlanRequest) -> MemoryPlan:
    """The memory plan of the `train hf` run ``config`` describes (config.json and manifests only)."""
    from transformers import AutoConfig

    from train.models import ModelLoadError

    if not (config.model / "config.json").is_file():
        raise ModelLoadError(f"{config.model}: no config.json; pass a Hugging Face model directory to --model")
    pack_size = read_packed_output(config.data).manifest.pack_size
    model_config = AutoConfig.from_pretrained(str(config.model))
    shape = model_shape(model_config, lora_rank=config.lora_rank, lora_targets=tuple(config.lora_targets))
    return plan_memory(shape, plan_inputs(config, request, pack_size))
