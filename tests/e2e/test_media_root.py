"""Media confinement (issue 29): with ``--media-root`` (or a dataset entry's ``media_root``) a media
path that resolves outside the roots - by ``..``, as an absolute path or through a symlink - is a
``media_outside_root`` error row and its bytes are never read; paths that stay inside are kept.

Truths: the rows the test wrote and where it put the files; the errors and samples parts read
with pyarrow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from schemas.layout import ERRORS_DIR, SAMPLES_DIR
from tests.e2e.test_hostile_inputs import _row, _rows, tokenize, write_dataset

#: (path as the row gives it, inside the media root?)
ROWS = [
    ("good.png", True),
    ("sub/../good.png", True),  # a `..` that stays inside
    ("../../outside/secret.png", False),
    ("<abs>", False),  # absolute path to the outside file
    ("link.png", False),  # a symlink inside the root to the outside file
    ("inner_link.png", True),  # a symlink that stays inside
]


@pytest.fixture()
def hostile(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    write_dataset(root, {"d": []})
    (root / "media" / "sub").mkdir()
    Image.new("RGB", (200, 150), (1, 2, 3)).save(root / "media" / "good.png")
    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (120, 90), (4, 5, 6)).save(outside / "secret.png")
    os.symlink(outside / "secret.png", root / "media" / "link.png")
    os.symlink("good.png", root / "media" / "inner_link.png")
    rows = [_row(str(outside / "secret.png") if p == "<abs>" else p, f"row {i}") for i, (p, _) in enumerate(ROWS)]
    return write_dataset(root, {"d": rows})


def _lines(out: Path, folder: str, reason: str | None = None) -> list[int]:
    return sorted(r["line"] for r in _rows(out, folder) if reason is None or r["reason"] == reason)


INSIDE = [i for i, (_, inside) in enumerate(ROWS) if inside]
OUTSIDE = [i for i, (_, inside) in enumerate(ROWS) if not inside]


def test_without_a_media_root_every_path_is_followed(hostile, processor_dirs, tmp_path) -> None:
    """What the flag changes: by default the outside file is read like any other."""
    out = tmp_path / "tok"
    assert tokenize(hostile, processor_dirs["qwen2_vl"], out).exit_code == 0
    assert _lines(out, SAMPLES_DIR) == list(range(len(ROWS)))


def test_media_root_refuses_paths_resolving_outside(hostile, processor_dirs, tmp_path) -> None:
    out = tmp_path / "tok"
    media = hostile.parent / "media"
    result = tokenize(hostile, processor_dirs["qwen2_vl"], out, "--media-root", str(media), "--max-error-rate", "1")
    assert result.exit_code == 0, result.output
    assert _lines(out, ERRORS_DIR, "media_outside_root") == OUTSIDE
    assert _lines(out, SAMPLES_DIR) == INSIDE
    refs = {m["ref"] for s in _rows(out, SAMPLES_DIR) for m in s["media"]}
    assert not any("secret" in ref for ref in refs)
    messages = [e["message"] for e in _rows(out, ERRORS_DIR)]
    assert all("outside the media roots" in m and "--media-root" in m for m in messages), messages
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["media_roots"] == [os.path.realpath(media)]


def test_a_dataset_entry_sets_media_root_and_cannot_widen_the_flag(hostile, processor_dirs, tmp_path) -> None:
    config = json.loads(hostile.read_text())
    config["d"]["media_root"] = "media"
    hostile.write_text(json.dumps(config))
    out = tmp_path / "entry"
    assert tokenize(hostile, processor_dirs["qwen2_vl"], out, "--max-error-rate", "1").exit_code == 0
    assert _lines(out, ERRORS_DIR, "media_outside_root") == OUTSIDE
    config["d"]["media_root"] = ["media", "../outside"]  # the entry allows the outside file...
    hostile.write_text(json.dumps(config))
    out = tmp_path / "narrowed"
    media = str(hostile.parent / "media")
    result = tokenize(hostile, processor_dirs["qwen2_vl"], out, "--media-root", media, "--max-error-rate", "1")
    assert result.exit_code == 0, result.output
    assert _lines(out, ERRORS_DIR, "media_outside_root") == OUTSIDE  # ...the flag does not
    config["d"]["media_root"] = "absent"
    hostile.write_text(json.dumps(config))
    bad = tokenize(hostile, processor_dirs["qwen2_vl"], tmp_path / "bad")
    assert bad.exit_code == 2 and "media_root" in bad.output and "is not a directory" in bad.output
