"""`prep tokenize` end to end on the generated example dataset.

Truths: the HF processor's own ``apply_chat_template(..., tokenize=True)`` on decoded
images, the input files (conservation), and an uninterrupted run (resume, determinism).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from prep.run import LOCAL, ExecutorConfig
from prep.tokenize.stage import OutputDirConflict, TokenizeConfig, run_tokenize
from schemas.dataset_config import load_dataset_config
from schemas.layout import ERRORS_DIR, MANIFEST_FILE, SAMPLES_DIR
from schemas.tokenized import list_parts, open_part

EXPECTED_REASONS = {
    "malformed_json",
    "not_utf8",
    "empty_conversation",
    "media_tag_mismatch",
    "missing_media",
    "missing_lmdb_key",
    "corrupt_image",
    "processor_rejected",
    "bad_video",
}


def _config(example: Path, out: Path, **kw) -> TokenizeConfig:
    base = dict(
        dataset_config=str(example / "dataset_info.json"),
        processor=str(example / "processor"),
        output_dir=str(out),
        executor=LOCAL,
        verify_fraction=1.0,
        rows_per_chunk=8,
        max_error_rate=1.0,  # the example holds one bad row per reason
    )
    return TokenizeConfig(**{**base, **kw})


def _table(out: Path, table: str) -> pa.Table:
    return pa.concat_tables([open_part(p) for p in list_parts(out, table)])


def _tree_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local_run(example_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tok") / "out"
    return out, run_tokenize(_config(example_dir, out))


def _expected_rows(example_dir: Path) -> int:
    from prep.sources.records import plan_chunks

    specs = load_dataset_config(example_dir / "dataset_info.json")
    return sum(sum(c.copies) for c in plan_chunks(specs, rows_per_chunk=8, seed=0))


def test_conservation_and_error_reasons(local_run, example_dir):
    out, manifest = local_run
    samples, errors = _table(out, SAMPLES_DIR), _table(out, ERRORS_DIR)
    assert samples.num_rows + errors.num_rows == _expected_rows(example_dir)
    ids = samples.column("sample_id").to_pylist() + errors.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids))
    assert EXPECTED_REASONS <= set(errors.column("reason").to_pylist())
    assert (manifest.rows.samples, manifest.rows.errors) == (samples.num_rows, errors.num_rows)
    assert manifest.tokens.total == sum(samples.column("num_tokens").to_pylist())
    assert all(m for m in errors.column("message").to_pylist())


def test_every_image_sample_equals_hf_processor(local_run, bundles, example_dir):
    """Independent of our verify path: HF's own chat-template + processor call per sample."""
    out, manifest = local_run
    processor = bundles["qwen2_vl"].processor
    specs = {s.name: s for s in load_dataset_config(example_dir / "dataset_info.json")}
    rows = _table(out, SAMPLES_DIR).to_pylist()
    checked = 0
    for row in rows:
        if any(m["kind"] == "video" for m in row["media"]) or row["copy"]:
            continue
        messages = _messages_with_images(row, specs[row["dataset"]])
        expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
        assert row["input_ids"] == list(expected), row["sample_id"]
        assert row["num_tokens"] == len(row["input_ids"]) == row["num_text_tokens"] + row["num_media_tokens"]
        checked += 1
    assert checked >= 10
    assert manifest.verify.checked >= checked


def _messages_with_images(row: dict, spec) -> list[dict]:
    import io

    from prep.sources.conversation import Conversation
    from prep.sources.formats.base import reader_for
    from prep.sources.media import LmdbPool, read_bytes
    from prep.sources.records import plan_chunks
    from schemas.media_ref import MediaRef

    chunk = next(c for c in plan_chunks([spec], rows_per_chunk=10**9, seed=0))
    conv = next(r.parsed for r in reader_for(spec).read(chunk) if r.line == row["line"])
    assert isinstance(conv, Conversation)
    images = iter(Image.open(io.BytesIO(read_bytes(MediaRef.parse(m["ref"]), LmdbPool()))) for m in row["media"])
    messages = []
    for message in conv.messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image", "image": next(images)} if c["type"] == "image" else c for c in content]
        messages.append({"role": message["role"], "content": content})
    return messages


def test_loss_mask_covers_exactly_the_assistant_replies(local_run, bundles):
    out, _ = local_run
    tokenizer = bundles["qwen2_vl"].tokenizer
    for row in _table(out, SAMPLES_DIR).to_pylist()[:20]:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(mask) == len(ids)
        learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        ignored = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert learned.count("<|im_end|>") == ignored.count("<|im_start|>assistant")
        assert "<|image_pad|>" not in learned and "<|im_start|>" not in learned


def test_media_columns_describe_each_item(local_run):
    out, _ = local_run
    rows = _table(out, SAMPLES_DIR).to_pylist()
    media = [m for r in rows for m in r["media"]]
    assert {m["kind"] for m in media} == {"image", "video"}
    for r in rows:
        assert r["num_media_tokens"] == sum(m["num_tokens"] for m in r["media"])
    for m in media:
        assert m["width"] > 0 and m["height"] > 0
        assert m["num_tokens"] == m["grid_t"] * m["grid_h"] * m["grid_w"] // 4
        if m["kind"] == "video":
            assert len(m["frame_indices"]) == len(m["timestamps"]) > 0


def test_rerun_is_byte_identical_and_resumes_after_loss(local_run, example_dir, tmp_path):
    out, _ = local_run
    again = tmp_path / "again"
    run_tokenize(_config(example_dir, again))
    assert _tree_bytes(again) == _tree_bytes(out)
    parts = list_parts(again, SAMPLES_DIR)
    parts[0].unlink()
    parts[-1].unlink()
    list_parts(again, ERRORS_DIR)[1].unlink()
    (again / SAMPLES_DIR / ".tmp-part-000000.arrow.123").write_bytes(b"half a part")
    run_tokenize(_config(example_dir, again))
    assert _tree_bytes(again) == _tree_bytes(out)


def test_output_dir_with_other_options_is_refused(local_run, example_dir):
    out, _ = local_run
    with pytest.raises(OutputDirConflict):
        run_tokenize(_config(example_dir, out, seed=7))


def test_max_length_turns_long_samples_into_errors(example_dir, tmp_path):
    manifest = run_tokenize(_config(example_dir, tmp_path / "o", max_length=64, verify_fraction=0.0))
    assert manifest.errors_by_reason.get("too_long", 0) > 0
    rows = _table(tmp_path / "o", SAMPLES_DIR)
    assert max(rows.column("num_tokens").to_pylist(), default=0) <= 64


def test_manifest_records_processor_and_versions(local_run):
    out, manifest = local_run
    on_disk = json.loads((out / MANIFEST_FILE).read_text())
    assert on_disk == manifest.to_json()
    assert manifest.processor.class_name == "Qwen2VLProcessor"
    assert len(manifest.processor.sha256) == 64
    assert "transformers" in manifest.libraries


@pytest.mark.ray
def test_ray_executor_matches_local(local_run, example_dir, tmp_path, ray_session):
    out, _ = local_run
    ray_out = tmp_path / "ray"
    run_tokenize(_config(example_dir, ray_out, executor=ExecutorConfig(executor="ray", num_workers=1)))
    assert _tree_bytes(ray_out) == _tree_bytes(out)


def test_qwen3_vl_image_samples_verify_against_its_processor(tmp_path):
    """Qwen3-VL: factor 32, no default system prompt; every image sample checked by the processor."""
    from prep.example.dataset import write_example_dataset

    config = write_example_dataset(tmp_path / "ex3", num_samples=16, seed=1, family="qwen3_vl")
    manifest = run_tokenize(_config(config.parent, tmp_path / "out3"))
    assert manifest.processor.class_name == "Qwen3VLProcessor"
    assert manifest.verify.checked >= 8
    rows = _table(tmp_path / "out3", SAMPLES_DIR).to_pylist()
    videos = [m for r in rows for m in r["media"] if m["kind"] == "video"]
    assert videos and all(m["num_tokens"] > 0 for m in videos)


def test_media_num_bytes_is_the_encoded_size(local_run):
    """num_bytes equals the file's size, or the length of the LMDB value, read directly."""
    import os

    import lmdb

    out, _ = local_run
    media = [m for r in _table(out, SAMPLES_DIR).to_pylist() for m in r["media"]]
    in_lmdb = [m for m in media if "::" in m["ref"]]
    assert in_lmdb and len(in_lmdb) < len(media)
    for m in media:
        path, _, key = m["ref"].partition("::")
        if key:
            with lmdb.open(path, readonly=True, lock=False, subdir=os.path.isdir(path)) as env, env.begin() as txn:
                expected = len(txn.get(key.encode("utf-8")))
        else:
            expected = os.path.getsize(path)
        assert m["num_bytes"] == expected, m["ref"]
