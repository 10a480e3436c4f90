"""`train hf` end to end on CPU: exact resume, falling loss, torchrun over two ranks, usage errors.

Truths: an uninterrupted run (for resume), the shards' own pack keys (for data coverage),
plain transformers loading the saved checkpoint, and the loss itself (for learning).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prep.energon.index import index_dataset
from prep.example.model import write_tiny_model
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.packed import read_packed_output
from schemas.train import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, checkpoint_name
from tests.shards.oracles import pack
from train.checkpoint import load_checkpoint, read_model_state
from train.cli import main
from train.distributed import DistContext
from train.metrics import read_metrics
from train.models import load_model

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
IMAGE_DATASET = "sharegpt_json"  # the example's image/text dataset (videos need torchvision)


@pytest.fixture(scope="module")
def run_inputs(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Image/text packs of the example (several shards, indexed) and a tiny random Qwen2-VL config."""
    root = tmp_path_factory.mktemp("train_hf")
    tok = root / "tok"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(example_dir / "dataset_info.json"),
            processor=str(example_dir / "processor"),
            output_dir=str(tok),
            datasets=(IMAGE_DATASET,),
            executor=LOCAL,
            max_error_rate=1.0,  # the example has deliberately bad rows
        )
    )
    packed = root / "packed"
    pack([tok], packed, pack_size=1024, shard_size="2packs")
    index_dataset(packed)
    model = write_tiny_model(root / "model", "qwen2_vl", example_dir / "processor")
    return {"data": packed, "model": Path(model), "processor": example_dir / "processor", "root": root}


def _train(inputs: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    args = [
        "hf",
        "--data", str(inputs["data"]),
        "--model", str(inputs["model"]),
        "--processor", str(inputs["processor"]),
        "--output", str(out),
        "--num-workers", "0",
        "--lr", "1e-3",
        "--warmup-steps", "2",
        *extra,
    ]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return read_metrics(out / METRICS_FILE)


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's whole model, read from its DCP shards in this process."""
    return read_model_state(out / CHECKPOINTS_DIR / checkpoint_name(step))


def test_resume_continues_with_the_same_batches_losses_and_weights(run_inputs, tmp_path):
    whole = _train(run_inputs, tmp_path / "whole", "--max-steps", "6", "--grad-accum", "2")
    _train(run_inputs, tmp_path / "split", "--max-steps", "6", "--stop-after", "3", "--grad-accum", "2")
    resumed = _train(run_inputs, tmp_path / "split", "--max-steps", "6", "--grad-accum", "2", "--resume")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert [m["pack_keys"] for m in resumed] == [m["pack_keys"] for m in whole]
    for a, b in zip(whole, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["num_label_tokens"] == b["num_label_tokens"]
    final_whole, final_resumed = _weights(tmp_path / "whole", 6), _weights(tmp_path / "split", 6)
    assert final_whole.keys() == final_resumed.keys()
    for name, tensor in final_whole.items():
        torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_uint8_and_float32_pixels_train_the_same_trajectory(run_inputs, tmp_path):
    """8-bit pixels made float in the step are the processor's floats bit for bit: every step's loss and
    gradient norm, and the final weights, equal a run that ships the processor's float32 output."""
    raw = _train(run_inputs, tmp_path / "uint8", "--max-steps", "3", "--save-every", "3")
    floats = _train(run_inputs, tmp_path / "float32", "--max-steps", "3", "--save-every", "3", "--pixels", "float32")
    assert sum(sum(m["media"]) for m in raw) > 0  # the steps held images (per rank)
    assert [(m["loss"], m["grad_norm"]) for m in raw] == [(m["loss"], m["grad_norm"]) for m in floats]
    a, b = _weights(tmp_path / "uint8", 3), _weights(tmp_path / "float32", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_thirty_steps_lower_the_loss_and_leave_a_loadable_checkpoint(run_inputs, tmp_path):
    from transformers import AutoModelForImageTextToText

    metrics = _train(run_inputs, tmp_path / "run", "--max-steps", "30", "--save-every", "10", "--lr", "3e-3")
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 30
    log_lines = [ln for ln in (tmp_path / "run" / "train.log").read_text().splitlines() if " step " in ln]
    assert len(log_lines) == 30 and "step 30/30 loss" in log_lines[-1]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    for m in metrics:
        assert m["num_real_tokens"] == m["num_tokens"]  # no --pad-to-multiple-of: no padding at all
        assert m["num_label_tokens"] > 0 and len(m["pack_keys"]) == 1
    final = tmp_path / "run" / FINAL_DIR  # the last checkpoint, exported when the run reached --max-steps
    assert (final / "tokenizer.json").is_file() and (final / "chat_template.jinja").is_file()
    reloaded = AutoModelForImageTextToText.from_pretrained(final)
    saved = _weights(tmp_path / "run", 30)
    assert reloaded.state_dict().keys() == saved.keys()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    # the trained model as `train hf` holds it: its own loader + the checkpoint, through the resume path
    trained = load_model(run_inputs["model"], seed=5, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(trained.parameters())
    load_checkpoint(tmp_path / "run" / CHECKPOINTS_DIR / checkpoint_name(30), CTX, model=trained, optimizer=optimizer)
    ids = torch.tensor([[5, 17, 230, 41, 9, 77, 3, 120]])
    with torch.no_grad():  # same weights, same attention kernel: equal to fp32 rounding of the same ops
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits)
    assert sorted(p.name for p in (tmp_path / "run" / CHECKPOINTS_DIR).iterdir()) == [
        "latest",
        checkpoint_name(10),
        checkpoint_name(20),
        checkpoint_name(30),
    ]


def test_usage_errors_say_what_to_fix(run_inputs, tmp_path):
    runner = CliRunner()
    base = ["hf", "--model", str(run_inputs["model"]), "--processor", str(run_inputs["processor"]), "--max-steps", "1"]
    unindexed = run_inputs["root"] / "unindexed"
    pack([run_inputs["root"] / "tok"], unindexed, pack_size=1024)
    result = runner.invoke(main, [*base, "--data", str(unindexed), "--output", str(tmp_path / "a")])
    assert result.exit_code == 2 and "energon-index" in result.output
    if not torch.cuda.is_available():
        result = runner.invoke(
            main, [*base, "--data", str(run_inputs["data"]), "--output", str(tmp_path / "b"), "--device", "cuda"]
        )
        assert result.exit_code == 3 and "CUDA" in result.output  # the machine lacks it: an environment error
    _train(run_inputs, tmp_path / "c", "--max-steps", "1")
    again = runner.invoke(main, [*base, "--data", str(run_inputs["data"]), "--output", str(tmp_path / "c")])
    assert again.exit_code == 2 and "--resume" in again.output


def _torchrun(inputs: dict[str, Path], out: Path, *extra: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "train.cli", "hf",
        "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", "0", "--device", "cpu", "--lr", "1e-3", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_torchrun_two_ranks_read_disjoint_packs_and_resume_exactly(run_inputs, tmp_path):
    num_packs = read_packed_output(run_inputs["data"]).manifest.packs.packs
    steps = max(1, num_packs // 2 // 2)  # within one pass over the data on each rank
    _torchrun(run_inputs, tmp_path / "whole", "--max-steps", str(2 * steps))
    metrics = read_metrics(tmp_path / "whole" / METRICS_FILE)
    first_pass = metrics[:steps]
    rank0 = [k for m in first_pass for k in m["pack_keys"][0]]
    rank1 = [k for m in first_pass for k in m["pack_keys"][1]]
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    assert all(len(m["pack_keys"]) == 2 and len(m["media"]) == 2 for m in metrics)
    _torchrun(run_inputs, tmp_path / "split", "--max-steps", str(2 * steps), "--stop-after", str(steps))
    _torchrun(run_inputs, tmp_path / "split", "--max-steps", str(2 * steps), "--resume")
    resumed = read_metrics(tmp_path / "split" / METRICS_FILE)
    assert [m["pack_keys"] for m in resumed] == [m["pack_keys"] for m in metrics]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in metrics], rel=1e-5)
    a, b = _weights(tmp_path / "whole", 2 * steps), _weights(tmp_path / "split", 2 * steps)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
