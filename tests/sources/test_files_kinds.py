"""Every file type LLaMA-Factory reads gives the rows that were written, in chunks that resume.

Truth: the Python rows each test writes itself (with pyarrow / json / csv, and with the real
``datasets`` library where installed), never our reader's output.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep.shards.read import MediaVanishedError, read_media
from prep.sources.media import LmdbPool, MediaError, image_header, read_bytes
from prep.sources.records import decode_record, plan_chunks, read_chunk
from schemas.dataset_config import ConfigError, DatasetSpec
from schemas.media_ref import MediaRef
from schemas.reasons import Reason

ROWS = [{"instruction": f"q{i}", "input": "", "output": f"answer {i}"} for i in range(23)]


def _spec(path: Path, **kw) -> DatasetSpec:
    return DatasetSpec(name="d", file_name=path, media_dir=path.parent, formatting="alpaca", **kw)


def _values(spec: DatasetSpec, rows_per_chunk: int = 5) -> list[tuple[int, object]]:
    chunks = plan_chunks([spec], rows_per_chunk=rows_per_chunk, seed=0)
    return [(r.line, decode_record(r)) for c in chunks for r in read_chunk(c)]


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


def _write(kind: str, path: Path, rows: list[dict]) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, pa.Table.from_pylist(rows).schema) as w:
            for k in range(0, len(rows), 6):
                w.write_table(pa.Table.from_pylist(rows[k : k + 6]))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "arrow"])
def test_every_file_type_gives_the_written_rows_in_order(tmp_path, kind):
    path = _write(kind, tmp_path / f"d.{kind}", ROWS)
    got = _values(_spec(path))
    want = [{**r, "input": None} if kind == "csv" else r for r in ROWS]  # CSV empty cell -> None, as pandas/datasets
    assert got == list(enumerate(want))


def test_a_directory_numbers_rows_across_its_files_and_chunks_stay_in_one_file(tmp_path):
    (tmp_path / "data").mkdir()
    for k in range(3):
        _write("parquet", tmp_path / "data" / f"part-{k}.parquet", ROWS[k * 8 : (k + 1) * 8])
    spec = _spec(tmp_path / "data")
    chunks = plan_chunks([spec], rows_per_chunk=5, seed=0)
    assert [(Path(c.source).name, c.file_row, len(c.copies)) for c in chunks] == [
        ("part-0.parquet", 0, 5), ("part-0.parquet", 5, 3), ("part-1.parquet", 0, 5),
        ("part-1.parquet", 5, 3), ("part-2.parquet", 0, 5), ("part-2.parquet", 5, 2),
    ]  # fmt: skip
    assert _values(spec) == list(enumerate(ROWS))
    assert plan_chunks([spec], rows_per_chunk=5, seed=0) == chunks  # resume plans the same chunks


def test_mixed_file_types_in_a_directory_are_refused(tmp_path):
    _write("jsonl", tmp_path / "a.jsonl", ROWS)
    _write("parquet", tmp_path / "b.parquet", ROWS)
    with pytest.raises(ConfigError, match="mix types"):
        plan_chunks([_spec(tmp_path)], rows_per_chunk=5, seed=0)


def test_split_picks_hub_layout_files_and_refuses_unknown_splits(tmp_path):
    (tmp_path / "data").mkdir()
    _write("parquet", tmp_path / "data" / "train-00000-of-00001.parquet", ROWS[:10])
    _write("parquet", tmp_path / "data" / "test-00000-of-00001.parquet", ROWS[10:])
    assert _values(_spec(tmp_path / "data")) == list(enumerate(ROWS[:10]))
    assert _values(_spec(tmp_path / "data", split="test")) == list(enumerate(ROWS[10:]))
    with pytest.raises(ConfigError, match="splits found \\['test', 'train'\\]"):
        _values(_spec(tmp_path / "data", split="validation"))
    with pytest.raises(ConfigError, match="single file"):
        _values(_spec(tmp_path / "data" / "test-00000-of-00001.parquet", split="test"))


def test_datasets_save_to_disk_and_dataset_dict_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
         "images": datasets.Sequence(datasets.Image())}
    )  # fmt: skip
    images = [_png(20 + i, 10) for i in range(5)]
    rows = [
        {"messages": [{"role": "user", "content": f"<image>{i}"}], "images": [{"bytes": b, "path": None}]}
        for i, b in enumerate(images)
    ]
    train = datasets.Dataset.from_list(rows, features=features)
    test = datasets.Dataset.from_list(rows[:2], features=features)
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))
    for location, split, want in (("one", "train", 5), ("dict", "train", 5), ("dict", "test", 2)):
        got = _values(_spec(tmp_path / location, split=split))
        assert [line for line, _ in got] == list(range(want))
        for line, value in got:
            assert isinstance(value, dict) and value["messages"] == rows[line]["messages"]
            ref = MediaRef.parse(value["images"][0])
            assert ref.is_table_cell and ref.name == "image.png"
            assert read_bytes(ref, LmdbPool()) == images[line]  # the original bytes, unchanged
            assert (image_header(ref, LmdbPool()).width, image_header(ref, LmdbPool()).num_bytes) == (
                20 + line,
                len(images[line]),
            )
    with pytest.raises(ConfigError, match="split 'validation' not in the DatasetDict"):
        _values(_spec(tmp_path / "dict", split="validation"))


def test_embedded_bytes_of_every_layout_are_read_back_unchanged(tmp_path):
    images = [_png(10 + i, 5 + i) for i in range(4)]
    table = pa.table(
        {
            "image": pa.array(images, pa.binary()),  # a plain binary column
            "images": pa.array([[{"bytes": b, "path": f"dir/pic{i}.jpeg"}] for i, b in enumerate(images)]),
            "odd/col&#": pa.array([[b] for b in images], pa.list_(pa.large_binary())),
            "by_path": pa.array([{"bytes": None, "path": f"files/{i}.png"} for i in range(4)]),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    for line, value in _values(_spec(tmp_path / "t.parquet"), rows_per_chunk=2):
        assert isinstance(value, dict)
        assert value["by_path"] == f"files/{line}.png"  # no bytes: the path, resolved later like any path
        for text in (value["image"], value["images"][0], value["odd/col&#"][0]):
            ref = MediaRef.parse(text)
            assert MediaRef.parse(ref.format()) == ref
            assert read_bytes(ref, LmdbPool()) == images[line]
        assert MediaRef.parse(value["images"][0]).name == f"pic{line}.jpeg"


def test_path_and_lmdb_reference_forms_are_unchanged():
    for text in ("/d/a.jpg", "/d/imgs.lmdb::train/0001.jpg", "/d/x#1.jpg", "/d/a b/c.png"):
        ref = MediaRef.parse(text)
        assert ref.format() == text and not ref.is_table_cell
    assert MediaRef.parse("a.jpg", "/base") == MediaRef(path="/base/a.jpg")


def test_a_vanished_or_wrong_cell_is_missing_media(tmp_path):
    pq.write_table(pa.table({"image": pa.array([_png(4, 4)], pa.binary())}), tmp_path / "t.parquet")
    bad = MediaRef.table_cell(str(tmp_path / "t.parquet"), 5, ("image",))
    with pytest.raises(MediaError) as err:
        image_header(bad, LmdbPool())
    assert err.value.reason == Reason.MISSING_MEDIA
    gone = MediaRef.table_cell(str(tmp_path / "gone.parquet"), 0, ("image",))
    with pytest.raises(MediaVanishedError, match="d:0:0"):
        read_media(gone.format(), "d:0:0", LmdbPool())


def test_num_samples_is_a_seeded_subset_and_combines_with_sample_ratio(tmp_path):
    path = _write("parquet", tmp_path / "d.parquet", ROWS)
    n = len(ROWS)

    def copies(**kw) -> np.ndarray:
        chunks = plan_chunks([replace(_spec(path), **kw)], rows_per_chunk=5, seed=3)
        return np.array([c for ch in chunks for c in ch.copies])

    few = copies(num_samples=10)
    assert few.sum() == 10 and few.max() == 1 and np.array_equal(few, copies(num_samples=10))
    many = copies(num_samples=n + 7)  # LLaMA-Factory: every row once, the rest drawn again
    assert many.sum() == n + 7 and many.min() >= 1
    half = copies(num_samples=10, sample_ratio=0.5)
    assert half.sum() == 5 and np.all(half <= few)
    assert np.array_equal(copies(num_samples=10, sample_ratio=2.0), 2 * few)
    assert np.array_equal(copies(), np.ones(n, dtype=np.int64))
