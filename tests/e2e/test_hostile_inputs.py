"""Hostile inputs (issue 20), each through the real `prep` CLI: a decompression bomb is one error
row and the run goes on (local and Ray executors), an empty dataset fails instead of vanishing,
unreadable media say why, and a pack that would hold no pack fails at `prep pack`.

Truths are read independently of the commands: the errors and samples parts with plain
pyarrow, the manifest JSON, the files the test wrote.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result
from PIL import Image

from packvlm.errors import ExitCode
from prep.cli import main
from prep.sources.media import DECODE_LIMIT_PIXELS
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR

BOMB_SIDE = 100_000  # 10^10 pixels claimed by a ~100-byte PNG


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_bomb_png(path: Path, side: int = BOMB_SIDE) -> Path:
    """A valid PNG whose header claims ``side`` x ``side`` grey pixels; its data holds one row."""
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    data = zlib.compress(b"\0" * (side + 1), 9)
    body = _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


def _row(image: str | None, text: str) -> dict:
    content = f"<image>{text}" if image else text
    row: dict = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    if image:
        row["images"] = [image]
    return row


def _entry(file_name: str) -> dict:
    return {
        "file_name": file_name,
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        "media_dir": "media",
    }


def write_dataset(root: Path, files: dict[str, list[dict] | str]) -> Path:
    """``dataset_info.json`` with one entry per file (a list of rows -> JSONL; a str -> raw text)."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "media").mkdir(exist_ok=True)
    config = {}
    for name, rows in files.items():
        suffix = ".json" if isinstance(rows, str) and rows.strip().startswith("[") else ".jsonl"
        path = root / "data" / f"{name}{suffix}"
        text = rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows)
        path.write_text(text)
        config[name] = _entry(f"data/{path.name}")
    (root / "dataset_info.json").write_text(json.dumps(config))
    return root / "dataset_info.json"


def _good_image(root: Path) -> str:
    Image.new("RGB", (200, 150), (10, 120, 200)).save(root / "media" / "good.png")
    return "good.png"


def tokenize(config: Path, processor: Path, out: Path, *extra: str, executor: str = "local") -> Result:
    args = ["tokenize", "--dataset-config", str(config), "--processor", str(processor), "--output", str(out)]
    args += ["--executor", executor, "--rows-per-chunk", "2", *extra]
    if executor == "ray":
        args += ["--num-workers", "1"]
    return CliRunner().invoke(main, args)


def _rows(out: Path, folder: str) -> list[dict]:
    parts = sorted((out / folder).glob("part-*.arrow"))
    return [row for p in parts for row in pa.ipc.open_file(pa.memory_map(str(p))).read_all().to_pylist()]


@pytest.fixture()
def bomb_dataset(tmp_path: Path) -> Path:
    root = tmp_path / "bomb"
    write_dataset(root, {"mixed": []})  # creates the folders
    good = _good_image(root)
    write_bomb_png(root / "media" / "bomb.png")
    rows = [_row(good, "first"), _row("bomb.png", "boom"), _row(None, "text only"), _row(good, "last")]
    return write_dataset(root, {"mixed": rows})


def _check_bomb_run(result: Result, out: Path) -> None:
    assert result.exit_code == 0, result.output + repr(result.exception)
    errors = _rows(out, ERRORS_DIR)
    assert [(e["line"], e["reason"]) for e in errors] == [(1, "image_too_large")]
    message = errors[0]["message"]
    assert f"{BOMB_SIDE * BOMB_SIDE:,} pixels" in message and f"{DECODE_LIMIT_PIXELS:,}" in message, message
    samples = _rows(out, SAMPLES_DIR)
    assert sorted(s["line"] for s in samples) == [0, 2, 3]  # every good row kept, nothing lost
    assert not any("bomb.png" in m["ref"] for s in samples for m in s["media"])  # so no pack (and no train) sees it
    assert "image_too_large: 1" in result.output


def test_decompression_bomb_is_an_error_row_and_the_run_goes_on(bomb_dataset, processor_dirs, tmp_path) -> None:
    out = tmp_path / "tok"
    result = tokenize(bomb_dataset, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1")
    _check_bomb_run(result, out)


@pytest.mark.ray
def test_decompression_bomb_on_ray_is_an_error_row_too(bomb_dataset, processor_dirs, tmp_path, ray_session) -> None:
    out = tmp_path / "tok"
    result = tokenize(bomb_dataset, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1", executor="ray")
    _check_bomb_run(result, out)


def test_max_image_pixels_is_an_option_capped_at_what_training_decodes(bomb_dataset, processor_dirs, tmp_path):
    out = tmp_path / "small"
    result = tokenize(
        bomb_dataset, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1", "--max-image-pixels", "29999"
    )
    assert result.exit_code == 0, result.output
    reasons = sorted((e["line"], e["reason"]) for e in _rows(out, ERRORS_DIR))
    assert reasons == [(0, "image_too_large"), (1, "image_too_large"), (3, "image_too_large")]  # 200x150 = 30,000
    assert "30,000 pixels > --max-image-pixels 29,999" in _rows(out, ERRORS_DIR)[0]["message"]
    too_high = tokenize(
        bomb_dataset, processor_dirs["qwen2_vl"], tmp_path / "x", "--max-image-pixels", str(DECODE_LIMIT_PIXELS + 1)
    )
    assert too_high.exit_code == ExitCode.USAGE and not (tmp_path / "x").exists()
    # the limit is where the decoder that training uses refuses: one pixel more raises there
    assert DECODE_LIMIT_PIXELS == 2 * Image.MAX_IMAGE_PIXELS


def test_an_empty_dataset_fails_and_stays_in_the_manifest(tmp_path, processor_dirs) -> None:
    root = tmp_path / "empty"
    config = write_dataset(root, {"good": [_row(None, "hello")], "empty": "", "empty_list": "[]"})
    out = tmp_path / "tok"
    result = tokenize(config, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1")
    assert result.exit_code == ExitCode.DATA, result.output
    assert "no rows at all" in result.output and "'empty'" in result.output and "'empty_list'" in result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["per_dataset"]["empty"] == {"samples": 0, "errors": 0}
    assert manifest["per_dataset"]["empty_list"] == {"samples": 0, "errors": 0}
    assert "empty_list" in result.output.split("per dataset:")[1]  # in the table too
    listed = CliRunner().invoke(main, ["errors", str(out), "--dataset", "empty"])
    assert listed.exit_code == 0, listed.output


def test_unreadable_media_and_data_files_say_why(tmp_path, processor_dirs) -> None:
    root = tmp_path / "why"
    config = write_dataset(root, {"d": []})
    (root / "media" / "folder.jpg").mkdir()
    os.symlink("loop.jpg", root / "media" / "loop.jpg")
    rows = [_row("folder.jpg", "a"), _row("loop.jpg", "b"), _row("absent.jpg", "c"), _row(None, "fine")]
    config = write_dataset(root, {"d": rows})
    out = tmp_path / "tok"
    result = tokenize(config, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1")
    assert result.exit_code == 0, result.output
    messages = {e["line"]: e["message"] for e in _rows(out, ERRORS_DIR)}
    assert "is a directory" in messages[0] and "does not exist" not in messages[0]
    assert "symlink loop" in messages[1] and "does not exist" not in messages[1]
    assert "does not exist" in messages[2]
    os.symlink("looped.jsonl", root / "data" / "looped.jsonl")
    (root / "dataset_info.json").write_text(json.dumps({"looped": _entry("data/looped.jsonl")}))
    looped = tokenize(config, processor_dirs["qwen2_vl"], tmp_path / "tok2")
    assert looped.exit_code == ExitCode.USAGE and "symlink loop" in looped.output, looped.output


def test_pack_that_would_write_no_pack_fails_naming_why(tmp_path, processor_dirs) -> None:
    config = write_dataset(tmp_path / "long", {"d": [_row(None, "word " * 40), _row(None, "more " * 40)]})
    tok = tmp_path / "tok"
    assert tokenize(config, processor_dirs["qwen2_vl"], tok).exit_code == 0
    out = tmp_path / "packed"
    args = ["pack", str(tok), "--output", str(out), "--pack-size", "16", "--max-oversize-rate", "1"]
    result = CliRunner().invoke(main, [*args, "--executor", "local"])
    assert result.exit_code == ExitCode.DATA, result.output
    assert "no pack to write: all 2 samples exceed --pack-size 16" in result.output
    assert not out.exists()


def test_a_config_with_unreadable_entries_warns_once_counting_them(tmp_path, processor_dirs, caplog) -> None:
    """A whole LLaMA-Factory dataset_info.json: the skipped entries are one line, not two per entry."""
    config = write_dataset(tmp_path / "mixed", {"good": [_row(None, "hello")]})
    raw = json.loads(config.read_text())
    raw.update({f"hub_{i}": {"hf_hub_url": f"org/data{i}"} for i in range(5)})
    raw["dpo"] = {**_entry("data/good.jsonl"), "ranking": True}
    config.write_text(json.dumps(raw))
    with caplog.at_level("INFO"):
        result = tokenize(config, processor_dirs["qwen2_vl"], tmp_path / "tok")
    assert result.exit_code == 0, result.output
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        "skipped 6 entries that prep tokenize cannot read: 5 not on local disk, 1 preference (DPO/RM/KTO) "
        "(-v lists each with what to do)"
    ]
