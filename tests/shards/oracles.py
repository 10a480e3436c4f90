"""Shared test data and oracles for pack / shards / energon tests.

Oracles read the inputs their own way: tokenized parts with pyarrow, media files with
``read_bytes`` and LMDB values with ``lmdb`` directly, shards with the stdlib ``tarfile``.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import lmdb
import numpy as np
import pyarrow as pa
import pytest

from prep.pack.shard_cut import parse_shard_size
from prep.pack.stage import PackConfig
from prep.pipeline import pack_and_shard
from prep.run import LOCAL
from schemas.codec import to_json
from schemas.tokenized import list_parts

_CACHE: dict[str, Path] = {}


def tokenized_dir(example_dir: Path, factory: pytest.TempPathFactory) -> Path:
    """`prep tokenize` of the example dataset, local executor, once per session."""
    from prep.tokenize.stage import TokenizeConfig, run_tokenize

    key = str(example_dir)
    if key not in _CACHE:
        out = factory.mktemp("tokenized") / "tok"
        run_tokenize(
            TokenizeConfig(
                dataset_config=str(example_dir / "dataset_info.json"),
                processor=str(example_dir / "processor"),
                output_dir=str(out),
                executor=LOCAL,
                max_error_rate=1.0,  # the example has deliberately bad rows
                rows_per_chunk=16,
            )
        )
        _CACHE[key] = out
    return _CACHE[key]


def pack(inputs: list[Path], out: Path, executor=LOCAL, **kw) -> dict:
    """`prep pack` (plan + shards) through the Python API; the pack manifest plus the shard list."""
    options = {"pack_size": 1024, "shard_size": "4packs", "max_oversize_rate": 1.0, **kw}
    options["shard_size"] = parse_shard_size(options["shard_size"])
    config = PackConfig(inputs=tuple(str(p) for p in inputs), output_dir=str(out), **options)
    manifest, shards = pack_and_shard(config, executor)
    assert shards is not None
    return {**manifest.to_json(), "shards": to_json(shards.shards)}


def tokenized_rows(root: Path) -> dict[str, dict]:
    """sample_id -> row, read with pyarrow from the parts."""
    rows = {}
    for part in list_parts(root):
        table = pa.ipc.open_file(pa.memory_map(str(part))).read_all()
        for row in table.to_pylist():
            rows[row["sample_id"]] = row
    return rows


def original_bytes(ref: str) -> bytes:
    path, sep, key = ref.partition("::")
    if not sep:
        return Path(path).read_bytes()
    env = lmdb.open(path, readonly=True, lock=False, subdir=Path(path).is_dir())
    try:
        with env.begin() as txn:
            return bytes(txn.get(key.encode()))
    finally:
        env.close()


def read_shard(path: Path) -> dict[str, dict[str, bytes]]:
    """key -> {suffix: bytes}; asserts members of a key are contiguous and metadata fixed."""
    packs: dict[str, dict[str, bytes]] = {}
    order: list[str] = []
    with tarfile.open(path, "r:") as tar:
        for info in tar:
            assert info.isfile() and info.mtime == 0 and info.uid == info.gid == 0
            assert info.uname == info.gname == "" and info.mode == 0o644
            key, _, suffix = info.name.partition(".")
            if not order or order[-1] != key:
                assert key not in packs, f"members of {key} not contiguous"
                order.append(key)
            packs.setdefault(key, {})[suffix] = tar.extractfile(info).read()
    return packs


def read_packed(out: Path) -> dict[str, dict[str, bytes]]:
    packs: dict[str, dict[str, bytes]] = {}
    for shard in sorted((out / "shards").glob("shard-*.tar")):
        got = read_shard(shard)
        assert got, f"empty shard {shard}"
        assert not set(got) & set(packs), "key repeated across shards"
        packs |= got
    return packs


def npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def check_pack_against_tokenized(
    meta: dict,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    media: dict[str, bytes],
    rows_by_input: list[dict[str, dict]],
) -> None:
    """The pack's arrays and media equal the tokenized samples it names, in order."""
    expected_ids, expected_mask, expected_media = [], [], []
    for s in meta["samples"]:
        row = rows_by_input[s["input"]][s["sample_id"]]
        expected_ids += row["input_ids"]
        expected_mask += row["loss_mask"]
        expected_media += [m["ref"] for m in row["media"]]
    assert input_ids.dtype == np.int32 and input_ids.tolist() == expected_ids
    assert loss_mask.dtype == np.uint8 and loss_mask.tolist() == expected_mask
    assert [m["ref"] for m in meta["media"]] == expected_media
    for m in meta["media"]:
        assert media[m["member"]] == original_bytes(m["ref"]), m
    assert meta["cu_seqlens"][-1] == len(expected_ids) <= meta["cu_seqlens_padded"][-1]
    assert "pack_size" not in meta  # stored once, in the pack manifest


def meta_of(members: dict[str, bytes]) -> dict:
    return json.loads(members["json"])
