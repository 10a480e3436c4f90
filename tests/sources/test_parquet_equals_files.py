"""The same rows as JSON + image files and as Parquet / Arrow with embedded bytes: one output.

tokenize (local executor, every sample verified against the real Qwen2-VL processor's
``input_ids``) then pack + shards; the tokenized ids, masks and media sizes and every shard
member except the pack JSON (which names where each image was read) are byte-identical, and
the media members are the original encoded bytes.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep.run import LOCAL
from prep.tokenize.stage import TokenizeConfig, run_tokenize
from tests.shards.oracles import pack, tokenized_rows

TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}


def _image(size: tuple[int, int], fmt: str, mode: str = "RGB", orientation: int | None = None) -> bytes:
    img = Image.new(mode, size, 120)
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, fmt, exif=exif)
    else:
        img.save(buf, fmt)
    return buf.getvalue()


IMAGES = {
    "a.jpg": _image((640, 480), "JPEG"),
    "b.png": _image((100, 37), "PNG", "RGBA"),
    "c.jpg": _image((300, 200), "JPEG", orientation=6),  # the processor sees 200x300
    "d.png": _image((29, 57), "PNG", "L"),
}
ROWS = [
    (["a.jpg"], "<image>What is this?", "A grey picture."),
    (["b.png", "c.jpg"], "Compare <image> and <image>.", "They differ in size."),
    ([], "Hello there.", "Hi."),
    (["d.png"], "<image>Tiny?", "Yes."),
    (["c.jpg"], "Rotated <image>", "Portrait."),
]


def _messages(prompt: str, answer: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]


def _files_form(root: Path) -> Path:
    (root / "media").mkdir(parents=True)
    for name, data in IMAGES.items():
        (root / "media" / name).write_bytes(data)
    rows = [{"conversations": _messages(p, a), "images": imgs} for imgs, p, a in ROWS]
    (root / "d.json").write_text(json.dumps(rows))
    return _config(root, {"file_name": "d.json", "media_dir": "media"})


def _parquet_form(root: Path, layout: str) -> Path:
    root.mkdir(parents=True)
    if layout == "image_struct":  # the Hugging Face datasets Image feature
        images = pa.array(
            [[{"bytes": IMAGES[n], "path": None} for n in imgs] for imgs, _, _ in ROWS],
            pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        )
    else:
        images = pa.array([[IMAGES[n] for n in imgs] for imgs, _, _ in ROWS], pa.list_(pa.binary()))
    table = pa.table({"conversations": [_messages(p, a) for _, p, a in ROWS], "images": images})
    if layout == "arrow_stream":  # what datasets.save_to_disk writes
        with pa.OSFile(str(root / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)
        return _config(root, {"file_name": "d.arrow"})
    pq.write_table(table, root / "d.parquet", row_group_size=2)
    return _config(root, {"file_name": "d.parquet"})


def _config(root: Path, entry: dict) -> Path:
    spec = {**entry, "formatting": "sharegpt", "columns": {"messages": "conversations", "images": "images"}}
    (root / "dataset_info.json").write_text(json.dumps({"d": {**spec, "tags": TAGS}}))
    return root / "dataset_info.json"


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Path:
    from families.qwen2_vl.processor_dir import build_processor_dir

    return build_processor_dir(tmp_path_factory.mktemp("proc") / "qwen2_vl", "qwen2_vl")


def _run(config: Path, processor: Path, out: Path) -> tuple[dict[str, dict], dict[str, bytes]]:
    manifest = run_tokenize(
        TokenizeConfig(
            dataset_config=str(config),
            processor=str(processor),
            output_dir=str(out / "tok"),
            executor=LOCAL,
            verify_fraction=1.0,
            rows_per_chunk=2,
        )
    )
    assert manifest.errors_by_reason == {} and manifest.verify.checked == len(ROWS)
    pack([out / "tok"], out / "packed", pack_size=4096)
    members: dict[str, bytes] = {}
    for shard in sorted((out / "packed").rglob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                data = tar.extractfile(m)
                members[f"{shard.name}/{m.name}"] = data.read() if data else b""
    return tokenized_rows(out / "tok"), members


def _without_refs(row: dict) -> dict:
    return {**row, "source": None, "media": [{**m, "ref": None} for m in row["media"]]}


@pytest.mark.parametrize("layout", ["image_struct", "binary_list", "arrow_stream"])
def test_embedded_bytes_tokenize_and_shard_like_files(tmp_path, processor, layout):
    files_rows, files_tar = _run(_files_form(tmp_path / "files"), processor, tmp_path / "out_files")
    table_rows, table_tar = _run(_parquet_form(tmp_path / "table", layout), processor, tmp_path / "out_table")
    assert {k: _without_refs(r) for k, r in table_rows.items()} == {k: _without_refs(r) for k, r in files_rows.items()}
    assert sorted(files_tar) == sorted(table_tar)  # same packs, same member names (extensions included)
    media = [k for k in files_tar if k.rsplit(".", 1)[-1] in ("jpg", "png")]
    assert len(media) == sum(len(imgs) for imgs, _, _ in ROWS)
    assert sorted(files_tar[k] for k in media) == sorted(IMAGES[n] for imgs, _, _ in ROWS for n in imgs)
    for key, data in files_tar.items():
        if not key.endswith(".json"):
            assert table_tar[key] == data, key
    refs = [m["ref"] for r in table_rows.values() for m in r["media"]]
    assert all("#row=" in ref for ref in refs)  # bytes stayed in the table: no image was written out
    assert not list((tmp_path / "table").rglob("*.jpg")) and not list((tmp_path / "table").rglob("*.png"))
