"""`train export`: a checkpoint's shards -> one ``save_pretrained`` directory plain transformers loads.

A checkpoint (`train.checkpoint`) holds the model as torch.distributed.checkpoint shards, the
model's config and the processor's files. Export reads the shards in one process (no process
group, any number of ranks wrote them), builds the model's Auto class from the config on the
meta device (no second copy of the weights, no random init), assigns the weights and calls
``save_pretrained``, then copies the processor's files beside them::

    train export OUT/checkpoints/step-00000030 --to ./my-model
    AutoModelForImageTextToText.from_pretrained("./my-model")   # or AutoModelForCausalLM
    AutoProcessor.from_pretrained("./my-model")

The directory is written under a temp name and renamed when complete. `train hf` exports its
last checkpoint to ``OUT/final`` when it reaches ``--max-steps`` (``--no-final-export``: not).
A LoRA checkpoint (``--lora-rank``: its shards hold base weights and adapters, its
``adapter_config.json`` the scale) exports merged: each adapted weight is ``W0 + (B @ A) * alpha / r``
(`train.lora.fold_adapters`); ``train hf --lora-export merged`` writes ``OUT/merged`` so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import click
import torch
from transformers import AutoConfig

from packvlm.errors import UsageError
from schemas.layout import TMP_PREFIX
from train.checkpoint import copy_processor_files, read_model_state
from train.lora import fold_adapters, is_adapter_parameter
from train.models import auto_model_class

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(UsageError):
    """The export destination or checkpoint is unusable; the message says what to change."""


def export_checkpoint(checkpoint: Path, dest: Path, *, dtype: str | None = None, replace: bool = False) -> Path:
    """Write ``dest``: ``save_pretrained`` of the checkpoint's model plus its processor files.

    Args:
        checkpoint: ``OUT/checkpoints/step-N`` (complete, this layout).
        dest: Directory to create.
        dtype: ``float32``/``bfloat16``/``float16`` to cast the weights to; None keeps the trained dtype.
        replace: Replace an existing ``dest`` (the run's own ``OUT/final``); otherwise refuse it.
    """
    if dest.exists() and not replace:
        raise ExportError(f"--to {dest} exists; remove it or choose another directory")
    state = read_model_state(checkpoint)
    if any(is_adapter_parameter(k) for k in state):
        state = fold_adapters(state, _lora_scale(checkpoint))
    config = AutoConfig.from_pretrained(str(checkpoint))
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if _is_meta(model, k)]  # tied weights come back with their twin
    if missing or unexpected:
        raise ExportError(
            f"{checkpoint}: its weights do not fit {type(model).__name__} (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); export with the packvlm and transformers that trained it"
        )
    model.tie_weights()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{TMP_PREFIX}{dest.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        copy_processor_files(checkpoint, tmp)
        if (checkpoint / "generation_config.json").is_file():
            shutil.copy2(checkpoint / "generation_config.json", tmp / "generation_config.json")
        if replace:
            shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _lora_scale(checkpoint: Path) -> float:
    """alpha / r of the adapter a LoRA checkpoint carries (its ``adapter_config.json``)."""
    path = checkpoint / "adapter_config.json"
    if not path.is_file():
        raise ExportError(f"{checkpoint} holds LoRA adapters but no adapter_config.json; export the run's checkpoint")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("use_rslora") or config.get("alpha_pattern") or config.get("rank_pattern"):
        raise ExportError(f"{path}: only plain LoRA (lora_alpha / r, as train hf writes) can be merged here")
    return float(config["lora_alpha"]) / float(config["r"])


def _is_meta(model: torch.nn.Module, name: str) -> bool:
    """A key ``load_state_dict`` reported missing is truly missing only if it stayed on the meta device."""
    try:
        return bool(model.get_parameter(name).is_meta)
    except AttributeError:
        return bool(model.get_buffer(name).is_meta)


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--to", "dest", type=click.Path(path_type=Path), required=True, help="Directory to write (must not exist)."
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default=None,
    help="Cast the weights (default: as trained, fp32 master weights).",
)
def export_command(checkpoint: Path, dest: Path, dtype: str | None) -> None:
    """Write a checkpoint as a save_pretrained directory with its processor files.

    \b
    train export ./example-out/run/checkpoints/step-00000030 --to ./example-out/model-30
    """
    path = export_checkpoint(checkpoint, dest, dtype=dtype)
    click.echo(f"exported {checkpoint} to {path} (loads with transformers' from_pretrained)")
