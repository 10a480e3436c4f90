"""`train.run_dir`: how both recipes claim OUT and find the checkpoint to resume, and their one loader constructor.

Truths: the files on disk (``_run.json``, the checkpoint pointer) and the recipes' own configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schemas.layout import RUN_FILE
from schemas.train import CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, STATE_DIR, TRAINER_STATE_FILE, checkpoint_name
from train.distributed import DistContext
from train.loader import LoaderConfig, rank_loader_config
from train.recipes.hf import HFTrainConfig
from train.run_dir import TrainRunConflict, claim_run_dir

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _claim(out: Path, *, resume: bool = False, fingerprint: dict[str, str] | None = None, **kwargs) -> Path | None:
    return claim_run_dir(
        out, fingerprint=fingerprint or {"lr": "0.1"}, command="train hf", resume=resume, ctx=CTX, **kwargs
    )


def _fake_checkpoint(out: Path, step: int) -> Path:
    path = out / CHECKPOINTS_DIR / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / STATE_DIR).mkdir()
    (path / TRAINER_STATE_FILE).write_bytes(b"")
    (out / CHECKPOINTS_DIR / LATEST_FILE).write_text(f"{path.name}\n")
    return path


def test_a_fresh_run_records_its_options_and_has_nothing_to_resume(tmp_path):
    out = tmp_path / "run"
    assert _claim(out) is None
    assert json.loads((out / RUN_FILE).read_text()) == {"command": "train hf", "lr": "0.1"}
    assert (out / CHECKPOINTS_DIR).is_dir()


def test_a_run_is_refused_without_resume_and_continued_with_it(tmp_path):
    out = tmp_path / "run"
    _claim(out)
    (out / METRICS_FILE).write_text("")
    with pytest.raises(TrainRunConflict, match="pass --resume"):
        _claim(out)
    with pytest.raises(TrainRunConflict, match=f"nothing to resume in {out}; drop --resume or pass --resume-if-exists"):
        _claim(out, resume=True)  # no checkpoint yet
    assert _claim(out, resume_if_exists=True) is None  # from step 0
    checkpoint = _fake_checkpoint(out, 3)
    assert _claim(out, resume=True) == checkpoint
    with pytest.raises(TrainRunConflict, match=r"lr: '0.1' -> '0.2'"):
        _claim(out, resume=True, fingerprint={"lr": "0.2"})


def test_a_recipe_without_resume_says_only_to_use_a_new_output(tmp_path):
    out = tmp_path / "run"
    _claim(out, subdirs=(), resumable=False)
    assert not (out / CHECKPOINTS_DIR).exists()
    (out / METRICS_FILE).write_text("")
    with pytest.raises(TrainRunConflict) as err:
        _claim(out, subdirs=(), resumable=False)
    assert "--resume" not in str(err.value) and "new --output" in str(err.value)


def test_another_commands_output_is_refused(tmp_path):
    out = tmp_path / "run"
    claim_run_dir(out, fingerprint={}, command="train megatron", resume=False, ctx=CTX, subdirs=(), resumable=False)
    with pytest.raises(TrainRunConflict, match="train megatron"):
        _claim(out, resume=True)


def test_fingerprints_skip_what_a_resume_may_change(tmp_path):
    hf = HFTrainConfig(data=tmp_path, model=tmp_path, processor=tmp_path, output=tmp_path, max_steps=3)
    assert {"resume", "save_every", "max_steps", "stop_after"}.isdisjoint(hf.fingerprint())
    assert hf.fingerprint()["lr"] == "0.0001" and hf.fingerprint()["sampling"] == "epoch"


def test_the_hf_recipe_builds_its_loader_from_its_flags(tmp_path):
    shared = {
        "data": tmp_path / "packed",
        "processor": tmp_path / "proc",
        "output": tmp_path,
        "max_steps": 1,
        "num_workers": 3,
        "packs_per_microbatch": 2,
        "seed": 5,
        "sampling": "buffer",
        "shuffle_buffer_size": 7,
    }
    hf = rank_loader_config(HFTrainConfig(model=tmp_path, **shared), model="m", rank=1, world_size=2)
    assert hf == LoaderConfig(
        data=str(tmp_path / "packed"),
        processor=str(tmp_path / "proc"),
        model="m",
        rank=1,
        world_size=2,
        num_workers=3,
        packs_per_microbatch=2,
        seed=5,
        sampling="buffer",
        shuffle_buffer_size=7,
    )
    cp = rank_loader_config(
        HFTrainConfig(model=tmp_path, **shared), model="m", rank=0, world_size=1, context_parallel_size=2
    )
    assert cp.context_parallel_size == 2
