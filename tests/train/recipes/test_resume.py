"""`train hf` resumed on another number of ranks (elastic), and what --resume does with nothing to resume.

9 text packs (one ~390-token row per 512-token pack, 5 shards), a tiny random Qwen2-VL. The
chain runs 2 ranks (torchrun, gloo) x grad_accum 1 for 2 steps, then 1 rank x grad_accum 2 for
2 steps, then 2 ranks again to step 7: the global batch is 2 packs throughout, 14 packs read,
so the epoch boundary (pack 9) falls inside step 5. Truths: the pack keys in the shards
(every pack of an epoch exactly once) and an uninterrupted one-rank run (the same packs per
step, the same losses and weights: the stream does not depend on the number of ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from prep.energon.index import index_dataset
from prep.example.model import write_tiny_model
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.train import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, checkpoint_name
from tests.shards.oracles import pack
from train.checkpoint import read_model_state
from train.cli import main
from train.metrics import read_metrics
from train.models import load_model

ROOT = Path(__file__).resolve().parents[3]
NUM_PACKS = 9
LR = 1e-3
STEPS = 7  # x 2 packs per step: epoch 0 and 5 packs of epoch 1


@pytest.fixture(scope="module")
def nine_packs(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    rows = [
        {"messages": [{"role": "user", "content": f"row {i} " + "word " * 120}, {"role": "assistant", "content": "ok"}]}
        for i in range(NUM_PACKS)
    ]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"}, "tags": tags}
    (root / "dataset_info.json").write_text(json.dumps({"rows": entry}))
    tok = root / "tok"
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(root / "dataset_info.json"),
            processor=str(example_dir / "processor"),
            output_dir=str(tok),
            executor=LOCAL,
        )
    )
    packed = root / "packed"
    manifest = pack([tok], packed, pack_size=512, shard_size="2packs", max_oversize_rate=0.0)
    assert manifest["plan"]["num_packs"] == NUM_PACKS
    index_dataset(packed)
    model = write_tiny_model(root / "model", "qwen2_vl", example_dir / "processor")
    return {"data": packed, "model": Path(model), "processor": example_dir / "processor"}


def _args(inputs: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", "1", "--device", "cpu", "--lr", str(LR), "--warmup-steps", "2",
        "--max-steps", str(STEPS), *extra,
    ]  # fmt: skip


@contextmanager
def _one_thread() -> Iterator[None]:
    """The torchrun ranks run with OMP_NUM_THREADS=1: the in-process runs match their arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _in_process(inputs: dict[str, Path], out: Path, *extra: str) -> None:
    with _one_thread():
        result = CliRunner().invoke(main, ["hf", *_args(inputs, out, *extra)], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _torchrun(inputs: dict[str, Path], out: Path, *extra: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "train.cli", "hf", *_args(inputs, out, *extra),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _shard_keys(packed: Path) -> set[str]:
    keys = set()
    for shard in packed.rglob("*.tar"):
        with tarfile.open(shard) as tar:
            keys.update(name.split(".", 1)[0] for name in tar.getnames())
    return keys


def _stream(metrics: list[dict]) -> list[list[str]]:
    """Each step's packs in stream order: rank by rank (grad_accum 1), or one rank's micro-batches in turn."""
    return [[key for rank in m["pack_keys"] for key in rank] for m in metrics]


def test_resume_on_one_rank_then_two_reads_every_pack_once_and_follows_the_uninterrupted_run(nine_packs, tmp_path):
    _in_process(nine_packs, tmp_path / "whole", "--grad-accum", "2")
    whole = read_metrics(tmp_path / "whole" / METRICS_FILE)
    chain = tmp_path / "chain"
    _torchrun(nine_packs, chain, "--stop-after", "2")  # 2 ranks
    _in_process(nine_packs, chain, "--grad-accum", "2", "--resume", "--stop-after", "4")  # 2 -> 1 rank
    _torchrun(nine_packs, chain, "--resume")  # 1 -> 2 ranks
    elastic = read_metrics(chain / METRICS_FILE)
    assert [len(m["pack_keys"]) for m in elastic] == [2, 2, 1, 1, 2, 2, 2]  # ranks per step as run
    order = [key for step in _stream(elastic) for key in step]
    assert len(order) == 2 * STEPS
    assert Counter(order[:NUM_PACKS]) == Counter(_shard_keys(nine_packs["data"]))  # epoch 0: each pack once
    assert len(set(order[NUM_PACKS:])) == len(order) - NUM_PACKS  # epoch 1 so far: no pack twice
    assert _stream(elastic) == _stream(whole)  # the same packs per step as one uninterrupted rank
    for a, b in zip(whole, elastic):  # 2-term gradient sums either way: equal up to fp32 reordering
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["num_label_tokens"] == b["num_label_tokens"]
    a, b = (
        read_model_state(tmp_path / "whole" / CHECKPOINTS_DIR / checkpoint_name(STEPS)),
        read_model_state(chain / CHECKPOINTS_DIR / checkpoint_name(STEPS)),
    )
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("k_proj.bias"):
            # softmax ignores a bias shared by every key: its gradient is 0 up to fp32 noise, which the
            # reduction order flips and Adam normalises to steps of up to ~lr each; bound it by that
            assert float((b[name] - a[name]).abs().max()) <= LR * STEPS, name
        else:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert (chain / FINAL_DIR / "model.safetensors").is_file()  # the run reached --max-steps on 2 ranks: exported


def test_resume_with_nothing_to_resume_is_refused_and_resume_if_exists_starts_fresh(nine_packs, tmp_path):
    out = tmp_path / "new"
    args = ["hf", *_args(nine_packs, out), "--num-workers", "0", "--max-steps", "1", "--no-final-export"]
    refused = CliRunner().invoke(main, [*args, "--resume"])
    assert refused.exit_code == 2
    assert (
        refused.output.strip()
        .splitlines()[-1]
        .endswith(f"nothing to resume in {out}; drop --resume or pass --resume-if-exists")
    )
    assert not out.exists()  # refused before anything was written
    fresh = CliRunner().invoke(main, [*args, "--resume-if-exists"])
    assert fresh.exit_code == 0, fresh.output
    assert [m["step"] for m in read_metrics(out / METRICS_FILE)] == [1] and not (out / FINAL_DIR).exists()
    again = CliRunner().invoke(main, [*args, "--resume-if-exists"])  # now there is one: resumed, nothing left to do
    assert again.exit_code == 0, again.output
    assert [m["step"] for m in read_metrics(out / METRICS_FILE)] == [1]


def test_lora_under_fsdp_resumes_and_exports_like_one_process(nine_packs, tmp_path):
    """--lora-rank on 2 FSDP2 ranks (--sharding full by default), stopped after step 2 and resumed, equals one
    uninterrupted process with --grad-accum 2 (the same 2 packs per step): losses and adapters up to fp32
    reordering (as above). Base weights in the checkpoint's shards are bit-identical to the initial model, the
    adapter file is written, and --lora-export merged gives a plain model: W0 + alpha / r * B @ A."""
    lora = ("--max-steps", "3", "--lora-rank", "4", "--lora-export", "merged")
    _in_process(nine_packs, tmp_path / "whole", "--grad-accum", "2", *lora)
    chain = tmp_path / "chain"
    _torchrun(nine_packs, chain, *lora, "--stop-after", "2")
    _torchrun(nine_packs, chain, *lora, "--resume")
    whole, resumed = read_metrics(tmp_path / "whole" / METRICS_FILE), read_metrics(chain / METRICS_FILE)
    assert _stream(resumed) == _stream(whole)
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in whole], rel=1e-5)
    initial = load_model(nine_packs["model"], seed=0, attn_implementation="sdpa").state_dict()
    state = read_model_state(chain / CHECKPOINTS_DIR / checkpoint_name(3))
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    assert base.keys() == initial.keys()
    for name, tensor in initial.items():
        assert torch.equal(base[name], tensor), name
    adapters = [load_file(out / CHECKPOINTS_DIR / checkpoint_name(3) / "adapter_model.safetensors") for out in
                (tmp_path / "whole", chain)]  # fmt: skip
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=1e-5, atol=1e-6, msg=key)
    merged = load_model(chain / "merged", seed=0, attn_implementation="sdpa").state_dict()
    assert merged.keys() == initial.keys()
    prefix, scale = "base_model.model.", 8 / 4  # alpha defaults to 2 x rank
    for name, tensor in merged.items():
        a = adapters[1].get(prefix + name.replace(".weight", ".lora_A.weight"))
        if a is None:
            assert torch.equal(tensor, initial[name]), name
            continue
        b = adapters[1][prefix + name.replace(".weight", ".lora_A.weight").replace("lora_A", "lora_B")]
        expected = initial[name].double() + scale * b.double() @ a.double()
        torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_no_final_checkpoint_trains_and_writes_no_checkpoint(nine_packs, tmp_path):
    """--no-final-checkpoint (the GPU suite's `train hf` part: a 3.75B checkpoint is ~60 GB): the steps and their
    metrics, no checkpoint and no OUT/final; with --lora-export merged (written from that checkpoint) refused."""
    out = tmp_path / "bench"
    args = ["hf", *_args(nine_packs, out), "--num-workers", "0", "--max-steps", "1", "--no-final-checkpoint"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert [m["step"] for m in read_metrics(out / METRICS_FILE)] == [1]
    assert not list((out / CHECKPOINTS_DIR).glob("step-*")) and not (out / FINAL_DIR).exists()
    merged = CliRunner().invoke(main, [*args[:-1], "--output", str(tmp_path / "m"), "--lora-rank", "2",
                                       "--lora-export", "merged", "--no-final-checkpoint"])  # fmt: skip
    assert merged.exit_code == 2 and "drop --no-final-checkpoint" in merged.output
