"""Every pack exactly once per epoch across ranks and workers (issue 20), read from what a real
`train hf` run records: the per-rank ``pack_keys`` of ``metrics.jsonl``.

2 ranks (torchrun, gloo on CPU) x 2 loader workers over 8 packs: 4 optimizer steps are one
epoch (2 packs per step). Truth: the pack keys in the shards themselves. Before issue 20,
Energon's shard slices plus a 100-pack shuffle buffer gave some packs twice in an epoch and
others never.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from prep.energon.index import index_dataset
from prep.example.model import write_tiny_model
from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from schemas.train import METRICS_FILE
from tests.shards.oracles import pack
from train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
NUM_PACKS = 8  # divisible by 2 ranks x 2 workers
RANKS, WORKERS = 2, 2


@pytest.fixture(scope="module")
def eight_packs(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Text rows of ~390 tokens in 512-token packs: one sample per pack, 8 packs in 4 shards."""
    root = tmp_path_factory.mktemp("sampling")
    rows = [
        {"messages": [{"role": "user", "content": f"row {i} " + "word " * 120}, {"role": "assistant", "content": "ok"}]}
        for i in range(NUM_PACKS)
    ]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"}, "tags": tags}
    (root / "dataset_info.json").write_text(json.dumps({"rows": entry}))
    tok = root / "tok"
    config = TokenizeConfig(
        dataset_config=str(root / "dataset_info.json"),
        processor=str(example_dir / "processor"),
        output_dir=str(tok),
        executor=LOCAL,
    )
    run_tokenize(config)
    packed = root / "packed"
    manifest = pack([tok], packed, pack_size=512, shard_size="2packs", max_oversize_rate=0.0)
    assert manifest["plan"]["num_packs"] == NUM_PACKS
    index_dataset(packed)
    model = write_tiny_model(root / "model", "qwen2_vl", example_dir / "processor")
    return {"data": packed, "model": Path(model), "processor": example_dir / "processor"}


def _shard_keys(packed: Path) -> set[str]:
    keys = set()
    for shard in packed.rglob("*.tar"):
        with tarfile.open(shard) as tar:
            keys.update(name.split(".", 1)[0] for name in tar.getnames())
    return keys


def _torchrun(inputs: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
        "-m", "train.cli", "hf",
        "--data", str(inputs["data"]), "--model", str(inputs["model"]), "--processor", str(inputs["processor"]),
        "--output", str(out), "--num-workers", str(WORKERS), "--device", "cpu", "--max-steps", "8", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return read_metrics(out / METRICS_FILE)


def _epochs(metrics: list[dict]) -> list[list[str]]:
    """Pack keys in consumption order (step, then rank), cut into epochs of NUM_PACKS."""
    order = [key for m in metrics for rank in m["pack_keys"] for key in rank]
    return [order[i : i + NUM_PACKS] for i in range(0, len(order), NUM_PACKS)]


def test_every_pack_once_per_epoch_across_ranks_and_workers(eight_packs, tmp_path) -> None:
    keys = _shard_keys(eight_packs["data"])
    assert len(keys) == NUM_PACKS
    metrics = _torchrun(eight_packs, tmp_path / "run")
    assert all(len(m["pack_keys"]) == RANKS for m in metrics)
    epochs = _epochs(metrics)
    assert len(epochs) == 2
    for epoch in epochs:
        assert Counter(epoch) == Counter(keys), Counter(epoch)  # each pack exactly once
    assert epochs[0] != epochs[1]  # a new order each epoch (seeded: the same on every run)
