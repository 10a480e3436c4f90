"""`train hf --freeze` and `--lora-*` end to end on CPU (tiny Qwen2-VL, the example's image packs).

Truths: the initial weights (the config-only model at the same seed, built independently by
`train.models.load_model`), the optimizer state the checkpoint holds, the merged export
recomputed from the adapter file (W0 + alpha / r * B @ A), and an uninterrupted run for resume.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from schemas.train import CHECKPOINTS_DIR, FINAL_DIR, STATE_DIR, checkpoint_name
from tests.train.recipes.test_hf import _train, run_inputs  # noqa: F401  (the fixture)
from train.cli import main
from train.models import load_model
from train.trainable import parameter_groups


def _initial(run_inputs) -> tuple[dict[str, torch.Tensor], dict[str, str]]:  # noqa: F811
    model = load_model(run_inputs["model"], seed=0, attn_implementation="sdpa")
    return _state(model), parameter_groups(model)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by in-memory name (saved files rename some: transformers' checkpoint conversion)."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _loaded(directory: Path) -> dict[str, torch.Tensor]:
    return _state(load_model(directory, seed=0, attn_implementation="sdpa"))


def test_frozen_towers_are_bit_identical_and_hold_no_optimizer_state(run_inputs, tmp_path):  # noqa: F811
    initial, groups = _initial(run_inputs)
    out = tmp_path / "frozen"
    metrics = _train(run_inputs, out, "--max-steps", "3", "--freeze", "vision", "--freeze", "projector")
    assert len(metrics) == 3 and sum(sum(m["media"]) for m in metrics) > 0  # images went through the tower
    final = _loaded(out / FINAL_DIR)  # the end-of-run export of step 3
    for name, group in groups.items():
        if group in ("vision", "projector"):
            assert torch.equal(final[name], initial[name]), name
        else:
            assert not torch.equal(final[name], initial[name]), name  # every language weight trained
    metadata = FileSystemReader(out / CHECKPOINTS_DIR / checkpoint_name(3) / STATE_DIR).read_metadata()
    moments = [m for k, m in metadata.state_dict_metadata.items() if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")]
    trained = sum(initial[n].numel() for n, g in groups.items() if g == "language")
    assert sum(m.size.numel() for m in moments) == 2 * trained  # type: ignore[union-attr]


def test_lora_changes_only_the_adapters_and_merges_exactly(run_inputs, tmp_path):  # noqa: F811
    initial, _ = _initial(run_inputs)
    out = tmp_path / "lora"
    rank, alpha = 4, 8.0
    args = ["--max-steps", "3", "--lora-rank", str(rank), "--lora-alpha", str(alpha), "--lora-export", "merged"]
    _train(run_inputs, out, *args, "--lora-targets", "q_proj,v_proj")
    checkpoint = out / CHECKPOINTS_DIR / checkpoint_name(3)
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj"}
    merged = _loaded(out / "merged")  # plain transformers loads it
    assert (out / "merged" / "tokenizer.json").is_file()
    prefix = "base_model.model."
    adapted = {k[len(prefix) :].rsplit(".lora_", 1)[0] + ".weight" for k in adapter}
    assert merged.keys() == initial.keys() and adapted < merged.keys()
    for name, tensor in merged.items():
        if name not in adapted:
            assert torch.equal(tensor, initial[name]), name  # every base weight as it was loaded
            continue
        a = adapter[prefix + name.replace(".weight", ".lora_A.weight")].double()
        b = adapter[prefix + name.replace(".weight", ".lora_B.weight")].double()
        assert float(b.abs().max()) > 0  # B starts at zero: it trained
        expected = initial[name].double() + alpha / rank * b @ a
        # one fp32 rounding of W0 + delta: |error| <= 2^-24 (|W0| + |delta|), plus the fp32 product
        torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_lora_resumes_exactly(run_inputs, tmp_path):  # noqa: F811
    args = ["--max-steps", "4", "--lora-rank", "4"]
    whole = _train(run_inputs, tmp_path / "whole", *args)
    _train(run_inputs, tmp_path / "split", *args, "--stop-after", "2")
    resumed = _train(run_inputs, tmp_path / "split", *args, "--resume")
    assert [m["pack_keys"] for m in resumed] == [m["pack_keys"] for m in whole]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in whole], rel=1e-6, abs=1e-6)
    name = "adapter_model.safetensors"
    a = load_file(tmp_path / "whole" / CHECKPOINTS_DIR / checkpoint_name(4) / name)
    b = load_file(tmp_path / "split" / CHECKPOINTS_DIR / checkpoint_name(4) / name)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_what_to_train_usage_errors(run_inputs, tmp_path, monkeypatch):  # noqa: F811
    runner = CliRunner()
    base = [
        "hf", "--data", str(run_inputs["data"]), "--model", str(run_inputs["model"]),
        "--processor", str(run_inputs["processor"]), "--max-steps", "1", "--num-workers", "0",
    ]  # fmt: skip
    both = runner.invoke(main, [*base, "--output", str(tmp_path / "a"), "--lora-rank", "4", "--freeze", "vision"])
    assert both.exit_code == 2 and "--freeze" in both.output
    every = [f"--freeze={g}" for g in ("vision", "projector", "language")]
    nothing = runner.invoke(main, [*base, "--output", str(tmp_path / "b"), *every])
    assert nothing.exit_code == 2 and "nothing to train" in nothing.output
    assert not (tmp_path / "b").exists()  # refused before the run directory is claimed
    bad = runner.invoke(main, [*base, "--output", str(tmp_path / "c"), "--lora-rank", "4", "--lora-targets", "qkv"])
    assert bad.exit_code == 2 and "q_proj" in bad.output  # names the layers it has
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    missing = runner.invoke(main, [*base, "--output", str(tmp_path / "d"), "--lora-rank", "4"])
    assert missing.exit_code == 3 and "pip install 'packvlm[lora]'" in missing.output
