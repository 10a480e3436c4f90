"""Validation loss (`train.evaluate`) and `train hf --eval-every` / `--report-to` on CPU.

Truths: the val split's pack keys read from its shard tars (coverage: every pack exactly once,
over 1, 2 and 3 ranks); the token-weighted loss recomputed here pack by pack from full logits
(`train.loss.token_loss_sum` over `train.forward.packed_forward`, summed in float64), the
saved checkpoint reloaded with plain transformers for the value `train hf` logged, and a run
without ``--eval-every`` for the training trajectory.

Tolerance: the evaluated loss takes the chunked head (`train.chunked_loss`) in a different
grouping of packs per micro-batch; each per-token fp32 cross-entropy (~7.4 here) then differs by
summation order only, a few ulps (~1e-6 relative), and the ratio of sums keeps that: rel 1e-5.
"""

from __future__ import annotations

import json
import os
import socket
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from prep.energon.index import index_dataset, parse_split_ratio
from prep.example.model import write_tiny_model
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.energon import read_index
from schemas.packed import META_MEMBER
from schemas.train import FINAL_DIR, METRICS_FILE
from tests.shards.oracles import pack
from train.cli import main
from train.distributed import DistContext
from train.evaluate import EVAL_FILE, evaluate, make_eval_loader, read_eval
from train.loader import LoaderConfig
from train.metrics import read_metrics


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


REL = 1e-5
IMAGE_DATASET = "sharegpt_json"


@pytest.fixture(scope="module")
def eval_inputs(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Image/text packs of 512 tokens, one per shard, 5 in train and 3 in val; a tiny random Qwen2-VL config."""
    root = tmp_path_factory.mktemp("evaluate")
    run_tokenize(
        TokenizeConfig(
            dataset_config=str(example_dir / "dataset_info.json"),
            processor=str(example_dir / "processor"),
            output_dir=str(root / "tok"),
            datasets=(IMAGE_DATASET,),
            executor=LOCAL,
            max_error_rate=1.0,
        )
    )
    packed = root / "packed"
    pack([root / "tok"], packed, pack_size=512, shard_size="1packs")
    index_dataset(packed, split_ratio=parse_split_ratio("0.6,0.4,0"))
    model = write_tiny_model(root / "model", "qwen2_vl", example_dir / "processor")
    return {"data": packed, "model": Path(model), "processor": example_dir / "processor", "root": root}


def val_keys(data: Path) -> list[str]:
    """Pack keys of the val split, read from its shard tars (not through Energon)."""
    keys = []
    for shard in read_index(data).splits["val"]:
        with tarfile.open(data / shard) as tar:
            keys += [m.name.split(".")[0] for m in tar if m.name.endswith(f".{META_MEMBER}")]
    return keys


def loader_config(inputs: dict[str, Path], **overrides: object) -> LoaderConfig:
    base = LoaderConfig(
        data=str(inputs["data"]), processor=str(inputs["processor"]), model=str(inputs["model"]),
        split="val", repeat=False, num_workers=0,
    )  # fmt: skip
    return replace(base, **overrides)  # type: ignore[arg-type]


def load(model_dir: Path) -> torch.nn.Module:
    from train.models import load_model

    return load_model(model_dir, seed=3, dtype=torch.float32, attn_implementation="packvlm_varlen", device="cpu")


def truth(model: torch.nn.Module, inputs: dict[str, Path]) -> tuple[float, int, list[str], float]:
    """Pack by pack from full logits: (token-weighted loss, label tokens, keys, mean of per-pack means)."""
    from train.forward import packed_forward
    from train.loss import token_loss_sum

    total, tokens, keys, means = 0.0, 0, [], []
    model.eval()
    with torch.no_grad():
        for batch in make_eval_loader(loader_config(inputs)):
            summed, count = token_loss_sum(packed_forward(model, batch), batch.labels)
            total += float(summed.double())
            tokens += count
            keys += batch.pack_keys
            means.append(float(summed) / count)
    return total / tokens, tokens, keys, sum(means) / len(means)


@pytest.fixture(scope="module")
def model_and_truth(eval_inputs: dict[str, Path]) -> tuple[torch.nn.Module, tuple[float, int, list[str], float]]:
    model = load(eval_inputs["model"])
    return model, truth(model, eval_inputs)


def test_truth_reads_every_val_pack_once_and_differs_from_a_mean_of_means(eval_inputs, model_and_truth):
    _, (loss, tokens, keys, mean_of_means) = model_and_truth
    assert sorted(keys) == sorted(val_keys(eval_inputs["data"])) and len(keys) == 3
    assert abs(mean_of_means - loss) > 10 * REL * loss  # the check below can tell the two apart


@pytest.mark.parametrize(("packs_per_microbatch", "num_workers"), [(1, 0), (2, 1), (3, 2)])
def test_one_rank_eval_equals_the_token_weighted_truth(eval_inputs, model_and_truth, packs_per_microbatch, num_workers):
    model, (loss, tokens, keys, _) = model_and_truth
    model.train()
    config = loader_config(eval_inputs, packs_per_microbatch=packs_per_microbatch, num_workers=num_workers)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    result = evaluate(model, make_eval_loader(config), ctx, step=7)
    assert model.training  # restored
    assert (result.step, result.num_label_tokens, result.num_packs) == (7, tokens, len(keys))
    assert result.loss == pytest.approx(loss, rel=REL)


def _rank_worker(rank: int, world: int, port: int, inputs: dict[str, Path], out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load(inputs["model"])
        loader = make_eval_loader(loader_config(inputs, rank=rank, world_size=world))
        read: list[str] = []

        def tapped():
            for batch in loader:
                read.extend(batch.pack_keys)
                yield batch

        ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
        result = evaluate(model, tapped(), ctx, step=1)
        record = {"loss": result.loss, "tokens": result.num_label_tokens, "packs": result.num_packs, "read": read}
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_every_val_pack_exactly_once_and_agree_on_the_truth(eval_inputs, model_and_truth, tmp_path):
    """2 ranks over 3 packs: one rank holds two, so the other repeats its batch (counted once) in lockstep."""

    _, (loss, tokens, keys, _) = model_and_truth
    world = 2
    mp.spawn(_rank_worker, args=(world, _free_port(), eval_inputs, tmp_path), nprocs=world, join=True)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    read = [key for record in records for key in record["read"]]
    assert sorted(read) == sorted(keys)  # every pack once across ranks, none twice
    assert sorted(len(record["read"]) for record in records) == [1, 2]  # uneven: the lockstep ran
    for record in records:  # every rank returns the global figure
        assert (record["tokens"], record["packs"]) == (tokens, len(keys))
        assert record["loss"] == pytest.approx(loss, rel=REL)


def _train(inputs: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    args = [
        "hf", "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", "0", "--lr", "1e-3", "--max-steps", "3", "--save-every", "3", *extra,
    ]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return read_metrics(out / METRICS_FILE)


def has_tensorboard() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def eval_run(eval_inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One `train hf --eval-every 2` run of 3 steps (reporting to tensorboard where it is installed)."""
    out = tmp_path_factory.mktemp("eval_run") / "run"
    report = ("--report-to", "tensorboard") if has_tensorboard() else ()
    return out, _train(eval_inputs, out, "--eval-every", "2", *report)


def test_train_hf_eval_every_logs_the_checkpoints_val_loss_and_keeps_the_trajectory(eval_inputs, eval_run, tmp_path):
    from transformers import AutoModelForImageTextToText

    out, evaluated = eval_run
    plain = _train(eval_inputs, tmp_path / "plain")
    assert [(m["loss"], m["grad_norm"], m["pack_keys"]) for m in evaluated] == [
        (m["loss"], m["grad_norm"], m["pack_keys"]) for m in plain
    ]  # evaluation changes no step
    rows = read_eval(out / EVAL_FILE)
    assert [r["step"] for r in rows] == [2, 3]  # every 2 steps and after the last
    model = AutoModelForImageTextToText.from_pretrained(
        out / FINAL_DIR, attn_implementation="packvlm_varlen"
    )  # the end-of-run export of step 3
    loss, tokens, keys, _ = truth(model, eval_inputs)
    assert (rows[-1]["num_label_tokens"], rows[-1]["num_packs"]) == (tokens, len(keys))
    assert rows[-1]["loss"] == pytest.approx(loss, rel=REL)
    log = (out / "train.log").read_text()
    assert "step 3/3 eval_loss" in log and "(train loss" in log


def test_eval_every_without_a_val_split_says_what_to_run(eval_inputs, tmp_path):
    unsplit = eval_inputs["root"] / "unsplit"
    pack([eval_inputs["root"] / "tok"], unsplit, pack_size=512, shard_size="1packs")
    index_dataset(unsplit)
    args = [
        "hf", "--data", str(unsplit), "--model", str(eval_inputs["model"]), "--processor",
        str(eval_inputs["processor"]), "--output", str(tmp_path / "x"), "--num-workers", "0", "--max-steps", "1",
        "--eval-every", "1",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--split-ratio 0.9,0.1,0" in result.output


def test_report_to_tensorboard_writes_step_eval_lr_and_memory_scalars(eval_run):
    if not has_tensorboard():
        pytest.skip("tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics = eval_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["train/loss"] == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in metrics]
    assert scalars["train/lr"] == [(m["step"], pytest.approx(m["lr"], rel=1e-6)) for m in metrics]
    rows = read_eval(out / EVAL_FILE)
    assert scalars["eval/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert [s for s, _ in scalars["memory/peak_gib"]] == [1, 2, 3] and all(v > 0 for _, v in scalars["memory/peak_gib"])


def wandb_history(path: Path) -> tuple[dict[int, dict[str, float]], bool]:
    """step -> logged values, read from an offline run's ``.wandb`` file, and whether its exit record
    is there: W&B's 7-byte header, then LevelDB log records (32 KiB blocks, 7-byte record headers;
    FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) holding ``wandb_internal_pb2.Record`` protos. Read here,
    not by wandb's own code."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, history, done = path.read_bytes(), 32768, 7, b"", {}, False
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        room = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (kind == 0 and length == 0):  # block trailer / padding
            position += room
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            done = done or record.WhichOneof("record_type") == "exit"
            if record.WhichOneof("record_type") == "history":
                items = {
                    (i.nested_key[0] if i.nested_key else i.key): json.loads(i.value_json) for i in record.history.item
                }
                history[int(items["_step"])] = items
    return history, done


def test_report_to_wandb_offline_needs_no_network(eval_inputs, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb); too heavy for the dev extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    metrics = _train(eval_inputs, tmp_path / "wb", "--eval-every", "3", "--report-to", "wandb")
    run_id = (tmp_path / "wb" / "wandb-run-id").read_text()
    files = list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1
    deadline = time.monotonic() + 60
    history, done = wandb_history(files[0])
    while not done and time.monotonic() < deadline:  # finish() returns before wandb-core has written it all
        time.sleep(0.5)
        history, done = wandb_history(files[0])
    assert sorted(history) == [1, 2, 3]
    for m in metrics:
        row = history[m["step"]]
        assert row["train/loss"] == pytest.approx(m["loss"], rel=1e-6) and row["train/lr"] == pytest.approx(m["lr"])
        assert row["memory/peak_gib"] > 0
    assert history[3]["eval/loss"] == pytest.approx(read_eval(tmp_path / "wb" / EVAL_FILE)[-1]["loss"], rel=1e-6)
    assert "eval/loss" not in history[1]
