"""The example dataset: config accepted by the schema, oracle consistent with the files."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest
from click.testing import CliRunner

from prep.example.cli import example_command
from prep.example.dataset import write_example_dataset
from schemas.dataset_config import load_dataset_config
from schemas.reasons import Reason


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example_dataset(tmp_path_factory.mktemp("ex"), num_samples=40, seed=0).parent


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_config_loads_with_both_spellings(example: Path) -> None:
    specs = {s.name: s for s in load_dataset_config(example / "dataset_info.json")}
    assert set(specs) == {"chat", "sharegpt_json"}
    assert specs["chat"].tags.role_tag == "role"
    assert specs["sharegpt_json"].tags.user_tag == "human"
    assert specs["sharegpt_json"].sample_ratio == 1.5
    assert all(s.video.max_frames == 64 and s.media_dir == example / "media" for s in specs.values())


def test_every_physical_line_is_a_row_and_reasons_are_valid(example: Path) -> None:
    expected = json.loads((example / "expected.json").read_text())
    lines = (example / "data" / "chat.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == expected["chat"]["rows"]
    for name in ("chat", "sharegpt_json"):
        entry = expected[name]
        assert entry["samples"] + len(entry["errors"]) == entry["rows"]
        assert {Reason(r) for r in entry["errors"].values()}  # every code is a known reason
    assert expected["chat"]["samples"] == 40
    assert b"" in lines[:-1]  # the blank row
    reasons = set(expected["chat"]["errors"].values())
    # not produced by a Qwen-VL example: too_long needs --max-length, unsupported_media a family without video
    # image_too_large: a decompression bomb, made by tests/e2e/test_hostile_inputs.py (not in the example);
    # media_outside_root: needs --media-root (tests/e2e/test_media_root.py)
    assert {r.value for r in Reason} - reasons == {
        "template_error",
        "too_long",
        "unsupported_media",
        "image_too_large",
        "media_outside_root",
    }


def test_good_rows_reference_existing_media_with_matching_tags(example: Path) -> None:
    expected = json.loads((example / "expected.json").read_text())["chat"]
    media = example / "media"
    env = lmdb.open(str(media / "images.lmdb"), readonly=True, lock=False)
    lines = (example / "data" / "chat.jsonl").read_bytes().split(b"\n")[:-1]
    good = [i for i in range(len(lines)) if str(i) not in expected["errors"]]
    with env.begin() as txn:
        for i in good:
            record = json.loads(lines[i].decode("utf-8"))
            text = "".join(m["content"] for m in record["messages"])
            images, videos = record.get("images", []), record.get("videos", [])
            assert (text.count("<image>"), text.count("<video>")) == (len(images), len(videos))
            for ref in images + videos:
                if "::" in ref:
                    assert txn.get(ref.split("::", 1)[1].encode()) is not None
                else:
                    assert (media / ref).is_file()
    env.close()


def test_named_rows_carry_their_feature(example: Path) -> None:
    expected = json.loads((example / "expected.json").read_text())["chat"]
    lines = (example / "data" / "chat.jsonl").read_bytes().split(b"\n")

    def row(name: str) -> dict:
        return json.loads(lines[expected["named_rows"][name]])

    assert row("assistant_leading_newlines")["messages"][1]["content"].startswith("\n\n")
    assert "<|im_start|>" in row("literal_im_start")["messages"][0]["content"]
    assert "<think>" in row("think")["messages"][1]["content"]
    assert row("system_turn")["messages"][0]["role"] == "system"
    assert any("::" in ref for ref in row("multi_image")["images"])
    assert row("video")["videos"][0].endswith(".mp4")


def test_generation_is_byte_identical_and_cli_works(example: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(example_command, [str(tmp_path / "again"), "--num-samples", "40"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "again" / "dataset_info.json")
    assert _tree(tmp_path / "again") == _tree(example)


def test_no_bad_rows_and_other_family(tmp_path: Path) -> None:
    config = write_example_dataset(tmp_path, num_samples=3, with_bad_rows=False, family="qwen3_vl")
    expected = json.loads((tmp_path / "expected.json").read_text())
    assert expected["chat"] == {
        "rows": 3,
        "samples": 3,
        "errors": {},
        "named_rows": {"text_only": 0, "image_file": 1, "image_lmdb": 2},
    }
    assert expected["sharegpt_json"]["errors"] == {}
    assert json.loads((config.parent / "processor" / "config.json").read_text())["model_type"] == "qwen3_vl"
