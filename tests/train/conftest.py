"""Shared train fixtures: the example dataset tokenized, packed and indexed for Energon.

``packed_example(media="images", pad_to_multiple_of=1, pack_size=1024)`` returns a
`PackedExample` built once per session per argument set:

- ``media="images"``: the example's image/text rows only (chat rows without videos plus the
  image-only ``sharegpt_json`` dataset): what CPU training without torchvision can encode.
- ``media="videos"``: the chat rows that carry a video (packs hold videos, often with images).

Processor family qwen2_vl (the ``example_dir`` fixture). Tokenize and pack run in-process
(``executor=LOCAL``), 3 packs per shard so every dataset spans several shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from prep.run import LOCAL
from schemas.packed import PackedOutput, read_packed_output

VIDEO_TAG = "<video>"


@dataclass(frozen=True)
class PackedExample:
    path: Path  # `prep pack` output, indexed by `prep energon-index` (all packs in "train")
    tokenized: Path  # the `prep tokenize` output it was packed from
    processor: Path  # processor directory (its config.json names model_type + token ids)
    packed: PackedOutput  # its manifests, read back through `schemas.packed`


def _split_chat_rows(chat_file: Path, out_dir: Path) -> dict[str, Path]:
    """chat.jsonl -> rows without video / rows with video (unparseable rows dropped)."""
    kept: dict[str, list[str]] = {"images": [], "videos": []}
    for raw in chat_file.read_bytes().splitlines():
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(record, dict):
            continue
        has_video = bool(record.get("videos")) or VIDEO_TAG in json.dumps(record)
        kept["videos" if has_video else "images"].append(json.dumps(record))
    paths = {}
    for name, rows in kept.items():
        paths[name] = out_dir / f"chat_{name}.jsonl"
        paths[name].write_text("\n".join(rows) + "\n", encoding="utf-8")
    return paths


def _dataset_config(example_dir: Path, out_dir: Path) -> Path:
    """dataset_info.json with datasets "images", "sharegpt_json" and "videos"; absolute paths."""
    original = json.loads((example_dir / "dataset_info.json").read_text("utf-8"))
    rows = _split_chat_rows(example_dir / original["chat"]["file_name"], out_dir)
    media = str(example_dir / original["chat"]["media_dir"])
    chat = {k: v for k, v in original["chat"].items() if k != "file_name"}
    sharegpt = dict(original["sharegpt_json"])
    config = {
        "images": {**chat, "file_name": str(rows["images"]), "media_dir": media},
        "videos": {**chat, "file_name": str(rows["videos"]), "media_dir": media},
        "sharegpt_json": {
            **sharegpt,
            "file_name": str(example_dir / sharegpt["file_name"]),
            "media_dir": str(example_dir / sharegpt["media_dir"]),
        },
    }
    path = out_dir / "dataset_info.json"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


MEDIA_DATASETS = {"images": ("images", "sharegpt_json"), "videos": ("videos",)}


@pytest.fixture(scope="session")
def packed_example(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., PackedExample]:
    """Factory of indexed packed datasets of the example (see module docstring); cached."""
    from prep.energon.index import index_dataset
    from prep.tokenize.stage import TokenizeConfig, run_tokenize
    from tests.shards.oracles import pack

    root = tmp_path_factory.mktemp("train_data")
    config = _dataset_config(example_dir, root)
    tokenized: dict[str, Path] = {}
    built: dict[tuple, PackedExample] = {}

    def build(*, media: str = "images", pad_to_multiple_of: int = 1, pack_size: int = 1024) -> PackedExample:
        key = (media, pad_to_multiple_of, pack_size)
        if key in built:
            return built[key]
        if media not in tokenized:
            out = root / f"tok_{media}"
            run_tokenize(
                TokenizeConfig(
                    dataset_config=str(config),
                    processor=str(example_dir / "processor"),
                    output_dir=str(out),
                    datasets=MEDIA_DATASETS[media],
                    executor=LOCAL,
                    max_error_rate=1.0,  # the example has deliberately bad rows
                    rows_per_chunk=16,
                )
            )
            tokenized[media] = out
        out = root / f"packed_{media}_{pack_size}_pad{pad_to_multiple_of}"
        pack([tokenized[media]], out, pack_size=pack_size, shard_size="3packs", pad_to_multiple_of=pad_to_multiple_of)
        index_dataset(out)
        built[key] = PackedExample(
            path=out, tokenized=tokenized[media], processor=example_dir / "processor", packed=read_packed_output(out)
        )
        return built[key]

    return build
