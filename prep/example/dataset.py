"""Write a small multimodal ShareGPT dataset, its media, processor and ``dataset_info.json``.

Layout of ``write_example_dataset(out)``::

    out/dataset_info.json     two datasets, format of schemas.dataset_config
    out/expected.json         oracle: rows per file, error reason per bad row, named rows
    out/processor/            the family's example processor (`families` examples)
    out/model/config.json     tiny random-init model config matching the processor (model.py)
    out/media/*.jpg|png       media.write_image_files
    out/media/images.lmdb/    encoded images under utf-8 keys, referenced "images.lmdb::KEY"
    out/media/videos/*.mp4    short MPEG-4 clips, 64x48..320x240, 8-40 frames
    out/data/chat.jsonl       "chat": OpenAI spelling (messages/role/content), JSONL
    out/data/sharegpt.json    "sharegpt_json": from/value spelling, JSON array, ratio 1.5

Media refs are relative to ``media_dir``; user turns carry ``<image>``/``<video>`` tags
matched in order with the record's ``images``/``videos`` lists (LLaMA-Factory style).

Every physical line of ``chat.jsonl`` is a row, numbered from 0: a blank line is a
malformed row (``malformed_json``), never skipped, so rows in == samples + errors.
With ``with_bad_rows`` each bad row carries exactly one defect, listed in expected.json.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from families.registry import example_family, family_of_example
from families.requirements import check_transformers
from prep.example.media import (
    garbage_bytes,
    make_image_bytes,
    write_corrupt_video,
    write_image_files,
    write_lmdb,
    write_video,
)
from prep.example.rows import bad_chat_rows, named_chat_rows, random_chat_row, sharegpt_records
from schemas.media_ref import MediaRef

logger = logging.getLogger(__name__)

CONFIG_FILE = "dataset_info.json"
EXPECTED_FILE = "expected.json"
VIDEO_SAMPLING = {"fps": 2.0, "min_frames": 4, "max_frames": 64}
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
LMDB = "images.lmdb"
# name -> (frames, fps, width, height)
VIDEOS = {
    "clip_64x48_8f_4fps": (8, 4.0, 64, 48),
    "clip_320x240_40f_10fps": (40, 10.0, 320, 240),
    "clip_160x120_30f_30fps": (30, 30.0, 160, 120),
    "clip_128x96_25f_12.5fps": (25, 12.5, 128, 96),
}


def _write_media(media_dir: Path) -> dict[str, str]:
    """Write every image, the LMDB and the videos; return name -> ref relative to media_dir."""
    refs = {name: path.name for name, path in write_image_files(media_dir).items()}
    lmdb_items = {
        "photo_800x600.jpg": make_image_bytes(800, 600, seed=20),
        "exif_rot6_320x240.jpg": make_image_bytes(320, 240, exif_orientation=6, seed=21),
        "rgba_128x96.png": make_image_bytes(128, 96, mode="RGBA", fmt="PNG", seed=22),
        "nested/图片_01.jpg": make_image_bytes(500, 375, seed=23),
        "corrupt.jpg": garbage_bytes(1024, seed=24),
    }
    write_lmdb(media_dir / LMDB, lmdb_items)
    refs |= {f"lmdb:{key}": MediaRef(path=LMDB, key=key).format() for key in lmdb_items}
    for index, (name, (frames, fps, width, height)) in enumerate(VIDEOS.items()):
        write_video(media_dir / "videos" / f"{name}.mp4", frames, fps, width, height, seed=index)
        refs[name] = f"videos/{name}.mp4"
    write_corrupt_video(media_dir / "videos" / "corrupt.mp4")
    refs["corrupt_video"] = "videos/corrupt.mp4"
    refs["lmdb_missing_key"] = MediaRef(path=LMDB, key="no_such_key.jpg").format()
    return refs


def _write_chat(path: Path, m: dict[str, str], num_samples: int, seed: int, with_bad: bool) -> dict[str, Any]:
    """Write chat.jsonl; return its oracle entry (rows, samples, errors, named rows)."""
    rng = random.Random(seed)
    named = list(named_chat_rows(m).items())[:num_samples]
    good = [(name, json.dumps(rec, ensure_ascii=False).encode("utf-8")) for name, rec in named]
    while len(good) < num_samples:
        good.append(("", json.dumps(random_chat_row(rng, m), ensure_ascii=False).encode("utf-8")))
    bad = bad_chat_rows(m) if with_bad else []
    lines: list[bytes] = []
    errors: dict[str, str] = {}
    named_lines: dict[str, int] = {}
    bad_after = {(k + 1) * len(good) // (len(bad) + 1): k for k in range(len(bad))}
    for index, (name, raw) in enumerate(good):
        if index in bad_after:
            raw_bad, reason = bad[bad_after[index]]
            errors[str(len(lines))] = reason.value
            lines.append(raw_bad)
        if name:
            named_lines[name] = len(lines)
        lines.append(raw)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {"rows": len(lines), "samples": len(good), "errors": errors, "named_rows": named_lines}


def _write_sharegpt(path: Path, m: dict[str, str], num_records: int, seed: int, with_bad: bool) -> dict[str, Any]:
    """Write the JSON-array dataset; return its oracle entry."""
    records, errors = sharegpt_records(m, num_records, seed, with_bad)
    path.write_text(json.dumps(records, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return {"rows": len(records), "samples": len(records) - len(errors), "errors": errors}


def write_example_dataset(
    out_dir: Path,
    num_samples: int = 64,
    seed: int = 0,
    with_bad_rows: bool = True,
    family: str = "qwen2_vl",
) -> Path:
    """Write processor, media, two datasets and their config under ``out_dir``.

    Args:
        out_dir: Target directory (created; existing example files are overwritten).
        num_samples: Good rows in "chat"; the first ones are the named feature rows
            (``expected.json`` -> ``named_rows``), the rest seeded filler.
            "sharegpt_json" gets ``max(1, num_samples // 4)`` good records.
        seed: Seed of the filler rows; media and processor do not depend on it.
        with_bad_rows: Interleave one bad row per failure reason (see ``expected.json``).
        family: Example family (``families/<name>/example.py``, `families.registry`) for ``processor/`` and, where
            ``train`` runs it, ``model/``.

    Returns:
        Path of ``dataset_info.json``.

    Raises:
        TransformersVersionError: The installed transformers predates the family's classes.
    """
    out_dir = Path(out_dir)
    check_transformers(family_of_example(family))  # before the example imports the family's classes
    example = example_family(family)
    example.build_processor(out_dir / "processor")
    if example.build_model is not None:
        example.build_model(out_dir / "model", out_dir / "processor")
    refs = _write_media(out_dir / "media")
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    expected = {
        "chat": _write_chat(out_dir / "data" / "chat.jsonl", refs, num_samples, seed, with_bad_rows),
        "sharegpt_json": _write_sharegpt(
            out_dir / "data" / "sharegpt.json", refs, max(1, num_samples // 4), seed, with_bad_rows
        ),
    }
    config = {
        "chat": {
            "file_name": "data/chat.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images", "videos": "videos"},
            "tags": OPENAI_TAGS,
            "media_dir": "media",
            "video": VIDEO_SAMPLING,
        },
        "sharegpt_json": {
            "file_name": "data/sharegpt.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "images": "images", "system": "system"},
            "tags": SHAREGPT_TAGS,
            "media_dir": "media",
            "sample_ratio": 1.5,
            "video": VIDEO_SAMPLING,
        },
    }
    config_path = out_dir / CONFIG_FILE
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / EXPECTED_FILE).write_text(json.dumps(expected, indent=2, ensure_ascii=False) + "\n", "utf-8")
    logger.info("wrote example dataset (%s) to %s", family, config_path)
    return config_path
