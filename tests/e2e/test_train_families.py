"""Every family a user can prepare, they can train: the README chain per example family.

``prep example --family F`` -> ``prep tokenize`` -> ``prep pack`` -> ``prep energon-index`` ->
``train hf --max-steps 5``, in-process through the two click groups (one interpreter start for
all families), on the example's image/text dataset (``sharegpt_json``: system prompts, one and
several images, text-only turns; videos need torchvision, which CI lacks). Every command must
exit 0, every step's loss be finite, and the packs trained must be packs of the dataset; the
packed forward itself is proven exact per family in ``tests/train/``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from families.registry import example_families
from prep.cli import main as prep_main
from schemas.packed import pack_key, read_packed_output
from schemas.train import METRICS_FILE
from train.cli import main as train_main

#: every example family trains packed (Qwen3.5: gated delta nets reset per sample, train.linear_attention;
#: Gemma 3: bidirectional image blocks and sliding windows, train.block_attention)
TRAINED = example_families()
DATASET = "sharegpt_json"
PACK_SIZE = 16384  # tiled families expand two small images to ~4,500 tokens
STEPS = 5


#: examples whose processor exists only with torchvision: marked, run by CI in its torchvision env
NEEDS_TORCHVISION = {
    "kimi_k25",
}


def _family_params(names: tuple[str, ...]) -> list:
    return [pytest.param(f, marks=pytest.mark.torchvision) if f in NEEDS_TORCHVISION else f for f in names]


def _ok(result: Result, what: str) -> None:
    assert result.exit_code == 0, f"{what} exited {result.exit_code}:\n{result.output[-3000:]}"


@pytest.mark.parametrize("family", _family_params(TRAINED))
def test_example_chain_trains(family: str, tmp_path: Path) -> None:
    if family in NEEDS_TORCHVISION:
        pytest.importorskip("torchvision")
    prep, runner = (lambda *args: runner.invoke(prep_main, [str(a) for a in args])), CliRunner()
    ex, tok, packed, run = tmp_path / "ex", tmp_path / "tok", tmp_path / "packed", tmp_path / "run"
    _ok(prep("example", ex, "--family", family, "--num-samples", 8), "prep example")
    _ok(
        prep(
            "tokenize", "--dataset-config", ex / "dataset_info.json", "--processor", ex / "processor",
            "--output", tok, "--dataset", DATASET, "--executor", "local", "--max-error-rate", 1.0,
        ),
        "prep tokenize",
    )  # fmt: skip
    _ok(prep("pack", tok, "--output", packed, "--pack-size", PACK_SIZE, "--max-oversize-rate", 1.0), "prep pack")
    _ok(prep("energon-index", packed), "prep energon-index")
    args = ["hf", "--data", packed, "--model", ex / "model", "--processor", ex / "processor", "--output", run]
    result = runner.invoke(train_main, [str(a) for a in [*args, "--max-steps", STEPS, "--num-workers", 0]])
    _ok(result, "train hf")
    metrics = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and m["num_label_tokens"] > 0 for m in metrics)
    keys = {k for m in metrics for rank in m["pack_keys"] for k in rank}
    num_packs = read_packed_output(packed).manifest.packs.packs
    assert keys and keys <= {pack_key(i) for i in range(num_packs)}
    assert sum(m for step in metrics for m in step["media"]) > 0  # images were trained, not only text
