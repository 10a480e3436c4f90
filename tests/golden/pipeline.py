"""The example pipeline whose output bytes a refactor must not change.

It runs at a fixed path because tokenized rows and pack metadata record absolute media and
source paths; the recorded digests hold only for that path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

ROOT = Path("/tmp/packvlm-golden")
COMMANDS = (
    "prep example ./data",
    "prep tokenize --dataset-config ./data/dataset_info.json --processor ./data/processor"
    " --output ./tok --executor local --verify-fraction 0.3 --max-error-rate 1",
    "prep pack ./tok --output ./packed --pack-size 4096 --executor local --max-oversize-rate 1",
    "prep pack ./tok --output ./packed8 --pack-size 2048 --pad-to-multiple-of 8 --shard-size 1packs --executor local"
    " --max-oversize-rate 1",
)
# Columns of the tokenized tables as of schema version 1; later versions may add columns.
V1_COLUMNS = {
    "samples": (
        "sample_id",
        "dataset",
        "source",
        "line",
        "copy",
        "input_ids",
        "loss_mask",
        "num_tokens",
        "num_text_tokens",
        "num_media_tokens",
        "media",
    ),
}
V1_MEDIA_FIELDS = (
    "kind",
    "ref",
    "width",
    "height",
    "grid_t",
    "grid_h",
    "grid_w",
    "num_tokens",
    "frame_indices",
    "timestamps",
)


@contextmanager
def exclusive(root: Path = ROOT) -> Iterator[None]:
    """Hold the fixed path alone: two test runs on one machine would rebuild it under each other."""
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(root: Path = ROOT) -> None:
    """Run the example pipeline from scratch under ``root`` (hold `exclusive` around it and the digests)."""
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    for command in COMMANDS:
        done = subprocess.run(command.split(), cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr[-2000:]}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _table_digest(path: Path, kind: str) -> str:
    """Digest of a tokenized part's version-1 content (rows and metadata counts)."""
    table = pa.ipc.open_file(path).read_all()
    if kind in V1_COLUMNS:
        table = table.select(list(V1_COLUMNS[kind]))
    rows = table.to_pylist()
    for row in rows:
        if "media" in row:
            row["media"] = [{k: m[k] for k in V1_MEDIA_FIELDS} for m in row["media"]]
    meta = {
        k.decode(): v.decode()
        for k, v in (table.schema.metadata or {}).items()
        if k in (b"verified", b"verify_skipped")
    }
    return _sha(json.dumps({"rows": rows, "meta": meta}, sort_keys=True).encode())


# Fields of the pack json as of packed schema version 1; later versions may add fields.
V1_PACK_FIELDS = ("key", "pack_size", "num_tokens", "cu_seqlens", "cu_seqlens_padded", "samples", "media")
V1_PACKED_MEDIA_FIELDS = (
    "kind",
    "ref",
    "member",
    "sample",
    "grid_thw",
    "num_tokens",
    "frame_indices",
    "timestamps",
)


def _shard_digest(path: Path, pack_size: int) -> str:
    """Digest of a shard's members in order: bytes as they are, the pack json in its version-1 view.

    Version 3 stores the pack size once, in the pack manifest (``pack_size``): the view takes it
    from there, so the recording made when every pack json repeated it still holds.
    """
    members = []
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            data = tar.extractfile(member)
            content = data.read() if data else b""
            if member.name.endswith(".json"):
                raw = {"pack_size": pack_size, **json.loads(content)}
                view = {k: raw[k] for k in V1_PACK_FIELDS}
                view["media"] = [{k: m[k] for k in V1_PACKED_MEDIA_FIELDS} for m in raw["media"]]
                content = json.dumps(view, sort_keys=True).encode()
            members.append([member.name, member.size if not member.name.endswith(".json") else 0, _sha(content)])
    return _sha(json.dumps(members).encode())


def digests(root: Path = ROOT) -> dict[str, str]:
    """sha256 of every example media file; content digests of tokenized parts and shards."""
    out = {}
    for path in sorted((root / "data" / "media").rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = _sha(path.read_bytes())
    for kind in ("samples", "errors"):
        for path in sorted((root / "tok" / kind).glob("*.arrow")):
            out[str(path.relative_to(root))] = _table_digest(path, kind)
    for packed in ("packed", "packed8"):
        pack_size = json.loads((root / packed / "manifest.json").read_text())["pack_size"]
        for path in sorted((root / packed / "shards").glob("*.tar")):
            out[str(path.relative_to(root))] = _shard_digest(path, pack_size)
    return out


if __name__ == "__main__":
    run()
    print(json.dumps(digests(), indent=1, sort_keys=True))
