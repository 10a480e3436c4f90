"""A video pack without torchvision: exit 3 with the install line, before the run folder is claimed.

Truths: the shards' own tar member names (which packs hold a video), and the run folder on disk
(nothing left behind, so the very same command is not then refused as "holds a training run").
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from packvlm.errors import ExitCode
from packvlm.optional import MissingPackageError, is_installed, require_package
from prep.example.model import write_tiny_model
from schemas.energon import read_index
from schemas.layout import RUN_FILE
from schemas.train import CHECKPOINTS_DIR, METRICS_FILE
from train.cli import main
from train.distributed import DistContext
from train.preflight import first_video, split_pack_ranges
from train.run_dir import claim_run_dir, released_on_failure

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _video_members(root: Path, shards: list[str]) -> set[tuple[str, str]]:
    """(pack key, member) of every video in ``shards``, read from the tar headers themselves."""
    found = set()
    for shard in shards:
        with tarfile.open(root / shard) as tar:
            for name in tar.getnames():
                key, _, member = name.partition(".")
                if member.startswith("vid"):
                    found.add((key, member))
    return found


def test_first_video_names_a_video_the_split_holds_and_none_where_it_holds_none(packed_example):
    videos, images = packed_example(media="videos"), packed_example(media="images")
    index = read_index(videos.path)
    shards = list(index.shard_counts)
    truth = _video_members(videos.path, shards)
    assert truth, "the example's video rows must put videos in the packs"
    hit = first_video(videos.path, shard_packs=index.shard_counts, split_shards=index.splits["train"])
    assert hit is not None
    key, member = hit.removeprefix("pack ").split(", member ")
    assert (key, member) in truth
    # a split without the shards holding videos has none to name
    no_video = [s for s in shards if not _video_members(videos.path, [s])]
    assert first_video(videos.path, shard_packs=index.shard_counts, split_shards=no_video) is None
    image_index = read_index(images.path)
    assert _video_members(images.path, list(image_index.shard_counts)) == set()
    assert (
        first_video(images.path, shard_packs=image_index.shard_counts, split_shards=list(image_index.shard_counts))
        is None
    )


def test_split_pack_ranges_follow_the_shard_order():
    counts = {"a.tar": 3, "b.tar": 2, "c.tar": 4}
    assert split_pack_ranges(counts, ["a.tar", "c.tar"]) == [(0, 3), (5, 9)]
    assert split_pack_ranges(counts, []) == []


@pytest.mark.skipif(is_installed("torchvision"), reason="torchvision is installed: video packs train here")
def test_train_hf_on_a_video_pack_without_torchvision_exits_3_and_claims_nothing(packed_example, tmp_path):
    data = packed_example(media="videos")
    model = write_tiny_model(tmp_path / "model", "qwen2_vl", data.processor)
    out = tmp_path / "run"
    args = ["hf", "--data", str(data.path), "--model", str(model), "--processor", str(data.processor)]
    args += ["--output", str(out), "--max-steps", "2", "--num-workers", "0"]
    for _ in range(2):  # the same command again gets the same answer, not "holds a training run"
        result = CliRunner().invoke(main, args)
        assert result.exit_code == ExitCode.RESOURCE, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert "torchvision" in lines[0] and "pip install torchvision" in lines[0] and "member vid" in lines[0]
        assert not out.exists()


def _claimed(out: Path) -> None:
    claim_run_dir(out, fingerprint={"lr": "0.1"}, command="train hf", resume=False, ctx=CTX)


def test_a_run_failing_before_its_first_step_gives_the_folder_back(tmp_path):
    out = tmp_path / "run"
    _claimed(out)
    with pytest.raises(MissingPackageError), released_on_failure(out, CTX, created=True):
        require_package("packvlm_no_such_module", purpose="this test", install="pip install nothing")
    assert not out.exists()
    _claimed(out)  # claimable again
    assert (out / RUN_FILE).is_file()


def test_a_folder_the_user_made_or_a_run_with_a_step_is_kept(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    _claimed(mine)
    with pytest.raises(KeyboardInterrupt), released_on_failure(mine, CTX, created=False):
        raise KeyboardInterrupt
    assert mine.is_dir() and not any(mine.iterdir())
    stepped = tmp_path / "stepped"
    _claimed(stepped)
    with pytest.raises(RuntimeError), released_on_failure(stepped, CTX, created=True):
        (stepped / METRICS_FILE).write_text('{"step": 1}\n')
        raise RuntimeError("after a step")
    assert (stepped / RUN_FILE).is_file() and (stepped / CHECKPOINTS_DIR).is_dir()


def test_require_package_names_what_needs_it_and_the_install_line():
    require_package("json", purpose="nothing", install="-")  # present: no error
    with pytest.raises(MissingPackageError) as err:
        require_package(
            "peft_absent_here", purpose="LoRA adapters", install="pip install 'packvlm[lora]'", package="peft"
        )
    assert str(err.value) == "LoRA adapters need peft, which is not installed: pip install 'packvlm[lora]'"
    assert err.value.exit_code == ExitCode.RESOURCE
