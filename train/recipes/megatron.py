"""`train megatron`: a Megatron-Bridge recipe fine-tuned on our packs, from and back to HF weights.

Megatron-Bridge (``pip install 'packvlm[bridge]'``, Python 3.12) owns the loop: its recipe
(``--recipe``, e.g. ``qwen25_vl_7b_sft_config``) gives parallelism, optimizer, schedule and
precision; `build_config` then changes only what our data and flags decide, top to bottom:

1. the recipe is built with ``--hf-model`` in place of the hub id it names (Bridge's recipes
   hard-code their checkpoint, ``AutoBridge.from_hf_pretrained("Qwen/...")``), and the model
   provider loads those HF weights when the model is built (``to_megatron_provider(load_weights=True)``);
2. ``cfg.dataset`` is `train.bridge_data.PackedDatasetConfig`: our packs through Bridge's Energon
   data module and `train.bridge.BridgeTaskEncoder`; sequence length = pack size, micro-batch =
   packs joined into one THD row, validation off;
3. per-token loss (``calculate_per_token_loss``; gradients summed, divided by the global token
   count), the parallel sizes, iterations and learning rate from the flags;
4. checkpoints: Bridge's distributed (``torch_dist``) checkpoints under ``OUT/checkpoints``, loaded
   from there when present (a rerun resumes; same parallel sizes), logs under ``OUT``.

`run` checks the packs (identity, ``--pad-to-multiple-of 2*cp``) and the recipe's context-parallel
support (`context_parallel_problem`) before Bridge starts, calls ``finetune`` with Bridge's VLM
step, then - on rank 0 - exports the last checkpoint to HF format in ``OUT/hf`` (``export_ckpt``).
Bridge needs CUDA: ``finetune`` asserts it in ``initialize``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import click

from packvlm.cli import default_of
from packvlm.errors import UsageError
from packvlm.optional import require_package
from train.dataset import TrainConfigError, open_packed_dataset
from train.loader import LoaderConfig

log = logging.getLogger(__name__)
BRIDGE_INSTALL = "pip install 'packvlm[bridge]'  # Python 3.12; Megatron-Bridge's GPU stack: its container or docs"
CHECKPOINTS = "checkpoints"
HF_EXPORT = "hf"
PATH = click.Path(path_type=Path)

#: Bridge model providers whose model cannot train at context-parallel size > 1: where, and why.
#: Source: megatron-bridge 0.6.2 (= branch r0.6.0 at 6124fbe for these files).
#: ``models/qwen_vl/modeling_qwen25_vl.py`` and ``models/glm_vl/modeling_glm_45v.py``: ``forward``
#: hands the whole row (embeddings, labels, recomputed mRoPE) to the language model. A row cut on
#: our side cannot work either: the model merges every image of the row and recomputes the mRoPE
#: index from the whole ``input_ids``, so it must see the whole row.
#: ``models/gemma_vl/gemma3_vl_provider.py``: ``provide`` raises for CP != 1 (its model passes a
#: whole-row attention bias, causal plus bidirectional image blocks, that it cannot slice per rank).
_WHOLE_ROW = (
    "does not cut the row per context-parallel rank (it merges the images and computes mRoPE over the whole row)"
)
NO_CONTEXT_PARALLEL = {
    "Qwen25VLModelProvider": ("Qwen25VLModel.forward (models/qwen_vl/modeling_qwen25_vl.py)", _WHOLE_ROW),
    "GLM45VModelProvider": ("GLM45VModel.forward (models/glm_vl/modeling_glm_45v.py)", _WHOLE_ROW),
    "Gemma3VLModelProvider": (
        "Gemma3VLModelProvider.provide (models/gemma_vl/gemma3_vl_provider.py)",
        "refuses it (Gemma3VLModel's attention bias, causal plus bidirectional image blocks, covers the whole row)",
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronTrainConfig:
    """Every option of `train megatron`; the click flags take their defaults from here.

    ``None`` means "the recipe's value".
    """

    recipe: str
    hf_model: str
    data: Path
    output: Path
    processor: str | None = None  # default: --hf-model
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    packs_per_microbatch: int = default_of(LoaderConfig, "packs_per_microbatch")  # the loader flags: LoaderConfig's
    global_batch_size: int | None = None
    train_iters: int = 100
    warmup_iters: int | None = None  # default: the recipe's, or train_iters // 10 where that is >= train_iters
    lr: float | None = None
    min_lr: float | None = None
    save_interval: int | None = None
    num_workers: int = default_of(LoaderConfig, "num_workers")
    seed: int | None = None
    export: bool = True


def _default(name: str) -> Any:
    """The default of a MegatronTrainConfig field: defaults live only in the config class."""
    field = next(f for f in fields(MegatronTrainConfig) if f.name == name)
    return None if field.default is MISSING else field.default


def _int_option(flag: str, name: str, help_text: str, *, minimum: int = 1) -> Any:
    default = _default(name)
    return click.option(
        flag, name, type=click.IntRange(min=minimum), default=default, show_default=default is not None, help=help_text
    )


@click.command("megatron")
@click.option("--recipe", required=True, help="Megatron-Bridge recipe function, e.g. qwen25_vl_7b_sft_config.")
@click.option("--hf-model", required=True, help="HF model directory or hub id: the weights and config to start from.")
@click.option("--data", type=PATH, required=True, help="`prep pack` output indexed by `prep energon-index`.")
@click.option("--output", type=PATH, required=True, help="Run directory: checkpoints/, hf/ (the export), logs.")
@click.option("--processor", default=None, help="Processor the packs were tokenized with [default: --hf-model].")
@_int_option("--tensor-parallel", "tensor_parallel", "Tensor-parallel size.")
@_int_option("--pipeline-parallel", "pipeline_parallel", "Pipeline-parallel size.")
@_int_option("--context-parallel", "context_parallel", "Context-parallel size (packs need --pad-to-multiple-of 2x).")
@_int_option("--expert-parallel", "expert_parallel", "Expert-parallel size (MoE recipes).")
@_int_option("--packs-per-microbatch", "packs_per_microbatch", "Packs joined into one THD row (micro-batch size).")
@_int_option("--global-batch-size", "global_batch_size", "Packs per optimizer step [default: the recipe's].")
@_int_option("--train-iters", "train_iters", "Optimizer steps.")
@_int_option(
    "--warmup-iters", "warmup_iters", "Warm-up steps [default: the recipe's, or --train-iters // 10].", minimum=0
)
@click.option("--lr", type=float, default=None, help="Peak learning rate [default: the recipe's].")
@click.option("--min-lr", type=float, default=None, help="Final learning rate [default: the recipe's].")
@_int_option("--save-interval", "save_interval", "Steps between checkpoints [default: the recipe's].")
@_int_option("--num-workers", "num_workers", "Loader worker processes per rank.", minimum=0)
@click.option("--seed", type=int, default=None, help="Seed [default: the recipe's].")
@click.option("--export/--no-export", default=_default("export"), show_default=True, help="Write OUT/hf at the end.")
def megatron_command(**options: Any) -> None:
    """Fine-tune with a Megatron-Bridge recipe on the packs, from --hf-model's weights.

    Needs Megatron-Bridge (pip install 'packvlm[bridge]', Python 3.12) and CUDA GPUs; launch one
    process per GPU with torchrun. Checkpoints go to OUT/checkpoints (a rerun resumes from
    them), the final model to OUT/hf in HF format.
    """
    run(MegatronTrainConfig(**options))  # the `train` group maps its errors to exit codes


def require_bridge() -> None:
    """Exit 3 with the install line unless Megatron-Bridge is importable."""
    require_package(
        "megatron.bridge", purpose="`train megatron` runs", install=BRIDGE_INSTALL, package="megatron-bridge"
    )


def run(config: MegatronTrainConfig) -> None:
    """Build the Bridge config, fine-tune, export (see the module docstring)."""
    require_bridge()
    cfg = build_config(config)
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.vlm_step import forward_step

    finetune(cfg, forward_step)
    if config.export:
        export_hf(config)


def build_config(config: MegatronTrainConfig) -> Any:
    """Bridge's ``ConfigContainer`` for this run: the recipe, then our data and flags.

    Raises:
        TrainConfigError: the packs do not fit the run (identity, CP padding), or the recipe's
            model cannot run at ``--context-parallel``.
        UsageError: no Bridge recipe has that name.
    """
    from train.bridge_data import PackedDatasetConfig

    processor = config.processor or config.hf_model
    info = open_packed_dataset(config.data, processor, model=config.hf_model, cp_size=config.context_parallel)
    with recipe_checkpoint(config.hf_model):
        cfg = recipe_function(config.recipe)()
    problem = context_parallel_problem(cfg.model, config.context_parallel)
    if problem is not None:
        raise TrainConfigError(problem)
    model = cfg.model
    model.seq_length = info.pack_size
    model.tensor_model_parallel_size = config.tensor_parallel
    model.pipeline_model_parallel_size = config.pipeline_parallel
    model.context_parallel_size = config.context_parallel
    model.expert_model_parallel_size = config.expert_parallel
    model.sequence_parallel = model.sequence_parallel and config.tensor_parallel > 1
    model.calculate_per_token_loss = True  # sum over tokens, divided by the global token count
    cfg.ddp.average_in_collective = False  # Bridge requires it with per-token loss
    cfg.dataset = PackedDatasetConfig(
        path=str(info.path),
        processor=processor,
        model_config=config.hf_model,
        seq_length=info.pack_size,
        micro_batch_size=config.packs_per_microbatch,
        num_workers=config.num_workers,
        persistent_workers=config.num_workers > 0,
    )
    cfg.train.micro_batch_size = config.packs_per_microbatch
    cfg.train.train_iters = config.train_iters
    if config.global_batch_size is not None:
        cfg.train.global_batch_size = config.global_batch_size
    cfg.validation.eval_iters = 0
    _set_if_given(cfg.optimizer, lr=config.lr, min_lr=config.min_lr)
    _set_if_given(cfg.scheduler, lr_decay_iters=config.train_iters, lr_warmup_iters=warmup_iters(config, cfg.scheduler))
    _set_if_given(cfg.rng, seed=config.seed)
    checkpoints = str(config.output / CHECKPOINTS)
    cfg.checkpoint.save = checkpoints
    cfg.checkpoint.load = checkpoints  # resume when a checkpoint is there
    cfg.checkpoint.pretrained_checkpoint = None  # the HF weights come through the model provider
    _set_if_given(cfg.checkpoint, save_interval=config.save_interval)
    cfg.logger.tensorboard_dir = str(config.output / "tb_logs")
    return cfg


def warmup_iters(config: MegatronTrainConfig, scheduler: Any) -> int:
    """Warm-up steps: ``--warmup-iters``, else the recipe's while below ``--train-iters``, else a tenth of them.

    The recipes warm up for hundreds of steps (Qwen2.5-VL: 500); Bridge would cap that at
    ``train_iters - 1`` (the peak learning rate reached only at the last step), with a warning.

    Raises:
        TrainConfigError: ``--warmup-iters`` is not below ``--train-iters``.
    """
    if config.warmup_iters is not None:
        if config.warmup_iters >= config.train_iters:
            raise TrainConfigError(
                f"--warmup-iters {config.warmup_iters}: must be below --train-iters {config.train_iters}"
            )
        return config.warmup_iters
    recipe = int(scheduler.lr_warmup_iters or 0)
    return recipe if recipe < config.train_iters else config.train_iters // 10


def recipe_function(name: str) -> Any:
    """The recipe named ``name`` in ``megatron.bridge.recipes``.

    Raises:
        UsageError: no such recipe (names the VLM recipes with the same prefix).
    """
    recipes = importlib.import_module("megatron.bridge.recipes")
    found = getattr(recipes, name, None)
    if callable(found):
        return found
    prefix = name.split("_")[0]
    close = sorted(n for n in dir(recipes) if n.startswith(prefix) and n.endswith("_config"))
    raise UsageError(f"--recipe {name}: Megatron-Bridge has no such recipe; close names: {', '.join(close) or 'none'}")


@contextmanager
def recipe_checkpoint(hf_model: str) -> Iterator[None]:
    """While a recipe builds, every ``AutoBridge.from_hf_pretrained`` reads ``hf_model`` with its weights.

    The recipes name their hub checkpoint and call ``to_megatron_provider(load_weights=False)``;
    here the first is ours and the second loads the weights (a pre-wrap hook: each rank reads
    its own shard when Bridge builds the model).
    """
    from megatron.bridge import AutoBridge

    original_from = AutoBridge.__dict__["from_hf_pretrained"]
    original_to = AutoBridge.to_megatron_provider

    def from_ours(cls: type, _recipe_path: Any, **kwargs: Any) -> Any:
        return original_from.__func__(cls, hf_model, **kwargs)

    def with_weights(self: Any, load_weights: bool = True, hf_path: Any = None) -> Any:
        return original_to(self, load_weights=True, hf_path=hf_path)

    AutoBridge.from_hf_pretrained = classmethod(from_ours)
    AutoBridge.to_megatron_provider = with_weights
    try:
        yield
    finally:
        AutoBridge.from_hf_pretrained = original_from
        AutoBridge.to_megatron_provider = original_to


def context_parallel_problem(model_provider: Any, cp_size: int) -> str | None:
    """Why the recipe's model cannot train at context-parallel ``cp_size``; None if it can."""
    if cp_size == 1:
        return None
    known = NO_CONTEXT_PARALLEL.get(type(model_provider).__name__)
    if known is None:
        return None
    where, why = known
    return (
        f"--context-parallel {cp_size}: Megatron-Bridge's {where} {why}, so it cannot train at context-parallel "
        "size > 1; run with --context-parallel 1 (use --tensor-parallel / --pipeline-parallel for memory)"
    )


def export_hf(config: MegatronTrainConfig) -> None:
    """Rank 0 writes the last checkpoint of ``OUT/checkpoints`` to ``OUT/hf`` in HF format."""
    import torch.distributed as dist
    from megatron.bridge import AutoBridge

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    AutoBridge.from_hf_pretrained(config.hf_model).export_ckpt(
        config.output / CHECKPOINTS, config.output / HF_EXPORT, show_progress=False
    )
    log.info("train megatron: HF export in %s", config.output / HF_EXPORT)


def _set_if_given(target: Any, **values: Any) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(target, name, value)
