"""Which files a dataset entry names, and what kind each is.

LLaMA-Factory's ``file_name`` may be one file, a directory of files of one type, or (here as
well) a ``datasets.save_to_disk`` directory; ``cloud_file_name`` names the same on S3 / GCS.
File types follow LLaMA-Factory's ``FILEEXT2TYPE`` (``extras/constants.py``): json, jsonl,
csv, parquet, arrow. A ``.json`` file (or one with another extension, as before) is read as a
JSON array when it starts with ``[`` and as JSON lines otherwise.

``split`` selects, in this order: the split subdirectory of a ``DatasetDict.save_to_disk``
directory (``dataset_dict.json``); the files named after the split in a Hugging Face hub
layout (``train-00000-of-00002.parquet``, ``data/test.jsonl``, ``train/0.parquet``); any
other files are all the ``train`` split, as ``datasets.load_dataset(data_files=...)`` makes them.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from schemas.dataset_config import ConfigError

EXT_KINDS = {"parquet": "parquet", "arrow": "arrow", "csv": "csv", "json": "json", "jsonl": "json"}
SAVE_TO_DISK_STATE = "state.json"
DATASET_DICT = "dataset_dict.json"
CLOUD_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_CLOUD = re.compile(r"^(?P<scheme>s3|gs|gcs):/+(?P<rest>.*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class InputFile:
    """One file of a dataset: local path or ``s3://`` / ``gs://`` URL, and how to read it."""

    path: str
    kind: str  # "jsonl" | "json" (array) | "parquet" | "arrow" | "csv"


def is_cloud(path: str) -> bool:
    return _CLOUD.match(path) is not None


def cloud_url(path: str) -> str:
    """``s3://b/k`` form of a cloud path, also after POSIX normalisation made it ``s3:/b/k``."""
    m = _CLOUD.match(path)
    return f"{m['scheme']}://{m['rest']}" if m else path


def filesystem(url: str) -> Any:
    """The fsspec filesystem of a cloud URL; a missing client package is a config error naming it."""
    m = _CLOUD.match(url)
    if m is None:
        raise ValueError(f"{url!r} is not an s3:// or gs:// URL")
    package = CLOUD_PACKAGES[m["scheme"]]
    try:
        import fsspec

        __import__(package)
    except ImportError as exc:
        raise ConfigError(f"reading {url!r} needs the {package!r} package: pip install {package}") from exc
    return fsspec.filesystem(m["scheme"])


def open_input(path: str) -> IO[bytes]:
    """A binary file object for a local path or cloud URL."""
    if is_cloud(path):
        return filesystem(path).open(cloud_url(path), "rb")
    return open(path, "rb")


def _why_unreadable(path: str) -> str:
    """Why a local path that is neither a file nor a directory cannot be read, in words."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except PermissionError:
        return "cannot be read: permission denied"
    except OSError as exc:
        return "is a symlink loop" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
    return "is not a regular file"


def dataset_files(location: str, split: str, where: str) -> list[InputFile]:
    """The files of a dataset entry, in a fixed order, each with its kind.

    Args:
        location: the resolved ``file_name`` (absolute path) or ``cloud_file_name`` (URL).
        split: the split to read.
        where: ``dataset 'name'`` for messages.
    """
    fs = filesystem(location) if is_cloud(location) else None
    location = cloud_url(location)
    is_dir = fs.isdir(location) if fs is not None else Path(location).is_dir()
    if not is_dir:
        if fs is not None and not fs.isfile(location):
            raise ConfigError(f"{where}: {location!r} does not exist")
        if fs is None and not Path(location).is_file():
            raise ConfigError(f"{where}: {location!r} {_why_unreadable(location)}")
        if split != "train":
            raise ConfigError(f"{where}: split {split!r} asked of the single file {location!r} (its split is 'train')")
        return [InputFile(path=location, kind=file_kind(location))]
    names = sorted(_list_dir(location, fs))
    if DATASET_DICT in names:
        splits = json.loads(_read_text(f"{location}/{DATASET_DICT}", fs)).get("splits", [])
        if split not in splits:
            raise ConfigError(f"{where}: split {split!r} not in the DatasetDict at {location!r}; it has {splits}")
        return dataset_files(f"{location}/{split}", "train", where)
    if SAVE_TO_DISK_STATE in names:
        state = json.loads(_read_text(f"{location}/{SAVE_TO_DISK_STATE}", fs))
        files = [f"{location}/{f['filename']}" for f in state.get("_data_files", [])]
        if split not in ("train", state.get("_split") or "train"):
            raise ConfigError(f"{where}: {location!r} holds split {state.get('_split')!r}, not {split!r}")
        return [InputFile(path=f, kind="arrow") for f in files]
    files = [n for n in names if not PurePosixPath(n).name.startswith(".") and _ext(n) in EXT_KINDS]
    if not files:
        raise ConfigError(f"{where}: no {'/'.join(sorted(EXT_KINDS))} files in directory {location!r}")
    files = _select_split(files, split, where, location)
    kinds = {EXT_KINDS[_ext(n)] for n in files}
    if len(kinds) > 1:
        raise ConfigError(f"{where}: files in {location!r} mix types {sorted(kinds)}; LLaMA-Factory needs one type")
    return [InputFile(path=f"{location}/{n}", kind=file_kind(f"{location}/{n}")) for n in files]


def file_kind(path: str) -> str:
    """How one file is read: by extension; JSON and unknown extensions by the first byte."""
    kind = EXT_KINDS.get(_ext(path), "json")
    if kind != "json":
        return kind
    with open_input(path) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return "json" if head.startswith(b"[") else "jsonl"


def _select_split(names: list[str], split: str, where: str, location: str) -> list[str]:
    """Files of the split in a hub layout (split as first path part or name prefix), else all for 'train'."""
    split_of = {n: _split_name(n) for n in names}
    named = {s for s in split_of.values() if s is not None}
    if not named:
        if split != "train":
            raise ConfigError(f"{where}: split {split!r} asked, but the files in {location!r} are not split by name")
        return names
    chosen = [n for n in names if split_of[n] == split]
    if not chosen:
        raise ConfigError(f"{where}: no files of split {split!r} in {location!r}; splits found {sorted(named)}")
    return chosen


_SPLIT_NAMES = ("train", "validation", "valid", "val", "test", "dev", "eval")


def _split_name(rel: str) -> str | None:
    parts = PurePosixPath(rel).parts
    for part in parts[:-1]:
        if part in _SPLIT_NAMES:
            return part
    stem = re.split(r"[-_.]", parts[-1], maxsplit=1)[0]
    return stem if stem in _SPLIT_NAMES else None


def _ext(name: str) -> str:
    return PurePosixPath(name).suffix.lstrip(".").lower()


def _list_dir(location: str, fs: Any) -> list[str]:
    """Relative paths of the files under ``location`` (one level down for split folders)."""
    if fs is not None:
        base = location.split("://", 1)[-1].rstrip("/")
        found = [str(p) for p in fs.find(location, maxdepth=2)]
        return [p[len(base) + 1 :] for p in found if p.startswith(base + "/")]
    root = Path(location)
    paths = [p for top in root.iterdir() for p in (sorted(top.iterdir()) if top.is_dir() else [top])]
    return [p.relative_to(root).as_posix() for p in paths if p.is_file()]


def _read_text(path: str, fs: Any) -> str:
    if fs is not None:
        with fs.open(path, "rb") as fh:
            return bytes(fh.read()).decode("utf-8")
    return Path(path).read_text(encoding="utf-8")
