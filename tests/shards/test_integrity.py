"""Shard integrity (issue 29): ``shards.json`` records each shard's size and sha256; a truncated
shard is a data error (exit 1) wherever the shards are opened (`prep energon-index`, `train`),
a flipped byte one at ``prep energon-index --verify``; both name the shard and the fix, and the
fix (`prep shards` again) rewrites exactly the damaged shard, byte-identical to the original.

Truths: hashlib over the files, the bytes of the shards before damage.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from packvlm.errors import ExitCode
from prep.cli import main
from prep.energon.index import index_dataset
from schemas.manifest import SHARDS_MANIFEST_FILE, ShardsManifest, read_manifest
from schemas.packed import ShardIntegrityError, read_packed_output
from tests.shards.oracles import pack, tokenized_dir
from train.dataset import open_packed_dataset

DAMAGED = "shards/shard-000001.tar"


@pytest.fixture(scope="module")
def packed(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "packed"
    pack([tokenized_dir(example_dir, tmp_path_factory)], out, shard_size="3packs")
    index_dataset(out)
    return out


@pytest.fixture()
def copy(packed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(packed, tmp_path / "packed"))


def _run(*args: str):
    return CliRunner().invoke(main, [*args])


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "shards").glob("*.tar"))}


def test_shards_json_records_each_shards_size_and_sha256(packed: Path) -> None:
    manifest = read_manifest(packed / SHARDS_MANIFEST_FILE, ShardsManifest)
    assert manifest.schema_version == 2 and len(manifest.shards) >= 3
    for record in manifest.shards:
        data = (packed / record.name).read_bytes()
        assert (record.bytes, record.sha256) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_flipped_byte_fails_verify_naming_the_shard_and_prep_shards_repairs_it(copy: Path) -> None:
    before = _tree(copy)
    path = copy / DAMAGED
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result = _run("energon-index", str(copy), "--verify")
    assert result.exit_code == ExitCode.DATA, result.output
    assert DAMAGED in result.output and "sha256" in result.output and f"prep shards {copy}" in result.output
    repaired = _run("shards", str(copy), "--executor", "local")
    assert repaired.exit_code == 0, repaired.output
    assert _tree(copy) == before  # the damaged shard rewritten from the plan, the others untouched
    result = _run("energon-index", str(copy), "--verify")
    assert result.exit_code == 0, result.output


def test_a_truncated_shard_is_a_data_error_at_index_and_at_train_open(copy: Path) -> None:
    path = copy / DAMAGED
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 1024)
    result = _run("energon-index", str(copy))  # sizes are checked without --verify too
    assert result.exit_code == ExitCode.DATA, result.output
    assert f"{DAMAGED} is {size - 1024:,} bytes" in result.output and f"records {size:,}" in result.output
    with pytest.raises(ShardIntegrityError, match=f"{DAMAGED} is {size - 1024:,} bytes.*prep shards") as caught:
        open_packed_dataset(copy)
    assert caught.value.exit_code == ExitCode.DATA
    assert _run("shards", str(copy), "--executor", "local").exit_code == 0
    assert open_packed_dataset(copy).num_packs == read_packed_output(copy).manifest.packs.packs


def test_a_version_1_shards_json_is_read_and_prep_shards_records_the_hashes(copy: Path) -> None:
    manifest_path = copy / SHARDS_MANIFEST_FILE
    raw = json.loads(manifest_path.read_text())
    raw["schema_version"] = 1
    for record in raw["shards"]:
        del record["sha256"]
    manifest_path.write_text(json.dumps(raw))
    assert not read_packed_output(copy).shards.has_sha256
    result = _run("energon-index", str(copy), "--verify")  # sizes checked; hashes not recorded: a warning
    assert result.exit_code == 0, result.output
    assert _run("shards", str(copy), "--executor", "local").exit_code == 0
    assert read_manifest(manifest_path, ShardsManifest).has_sha256
