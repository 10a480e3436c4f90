"""``cloud_file_name`` against a local S3 server (moto's server mode on 127.0.0.1), never a real endpoint.

Truth: the rows and image bytes the test uploads with boto3.

Every test starts from nothing (issue 20: one of these failed in a full run and passed alone):
the server binds a port of its own choosing (picking a free port, closing it and binding it
again later raced with the Ray workers and other test runs binding ports on a shared machine),
moto's state is reset and the bucket made anew, and every per-process cache that outlives a
test is emptied: fsspec's S3FileSystem instances (bound to one endpoint, with listings cached),
and our own open Parquet readers and decoded batches, which are keyed by path only, so an
``s3://bkt/...`` path read earlier in the process (another server, an object since replaced)
was answered from memory.
"""

from __future__ import annotations

import io
import json
import sys
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prep.sources import tables
from prep.sources.media import LmdbPool, image_header, read_bytes
from prep.sources.records import decode_record, plan_chunks, read_chunk
from schemas.dataset_config import ConfigError, DatasetSpec
from schemas.media_ref import MediaRef

ROWS = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(9)]


def _forget_cached_readers() -> None:
    """Empty every per-process cache a cloud read fills (see the module docstring)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    tables._parquet.cache_clear()
    tables._CACHE.clear()


@pytest.fixture(scope="module")
def server():
    """A moto S3 server on 127.0.0.1 (a port it binds itself); env points s3fs/boto3 at it."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]), env["AWS_ENDPOINT_URL"]
    server.stop()
    _forget_cached_readers()  # nothing bound to this server outlives it


@pytest.fixture()
def s3(server):
    """A fresh bucket ``bkt`` on an emptied server, and no cached reader from earlier tests."""
    client, endpoint = server
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    _forget_cached_readers()
    client.create_bucket(Bucket="bkt")
    return client


def _spec(url: str) -> DatasetSpec:
    return DatasetSpec(
        name="d", file_name=Path(url), media_dir=Path("/"), formatting="alpaca", cloud_file_name=url
    )  # fmt: skip


def _values(spec: DatasetSpec) -> list[tuple[int, object]]:
    return [(r.line, decode_record(r)) for c in plan_chunks([spec], rows_per_chunk=4, seed=0) for r in read_chunk(c)]


def test_jsonl_json_and_a_prefix_of_parquet_files_on_s3(s3):
    s3.put_object(Bucket="bkt", Key="d.jsonl", Body="".join(json.dumps(r) + "\n" for r in ROWS).encode())
    s3.put_object(Bucket="bkt", Key="d.json", Body=json.dumps(ROWS).encode())
    for k in range(3):
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(ROWS[k * 3 : (k + 1) * 3]), buf, row_group_size=2)
        s3.put_object(Bucket="bkt", Key=f"dir/part-{k}.parquet", Body=buf.getvalue())
    for url in ("s3://bkt/d.jsonl", "s3://bkt/d.json", "s3://bkt/dir"):
        assert _values(_spec(url)) == list(enumerate(ROWS)), url


def test_embedded_image_bytes_on_s3_are_read_back_unchanged(s3):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (33, 21), 7).save(buf, "JPEG")
    jpeg = buf.getvalue()
    table = pa.table(
        {"messages": [[{"role": "user", "content": "<image>"}]], "images": [[{"bytes": jpeg, "path": "x.jpg"}]]}
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    s3.put_object(Bucket="bkt", Key="img.parquet", Body=out.getvalue())
    ((_, value),) = _values(_spec("s3://bkt/img.parquet"))
    assert isinstance(value, dict)
    ref = MediaRef.parse(value["images"][0])
    assert ref.path == "s3://bkt/img.parquet" and ref.name == "x.jpg"
    assert read_bytes(ref, LmdbPool()) == jpeg
    header = image_header(ref, LmdbPool())
    assert (header.width, header.height, header.num_bytes) == (33, 21, len(jpeg))


def test_a_missing_object_is_a_config_error(s3):
    with pytest.raises(ConfigError, match="does not exist"):
        plan_chunks([_spec("s3://bkt/nope.jsonl")], rows_per_chunk=4, seed=0)


def test_without_the_client_package_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs -> ImportError, installed or not
    with pytest.raises(ConfigError, match="pip install gcsfs"):
        plan_chunks([_spec("gs://bucket/d.jsonl")], rows_per_chunk=4, seed=0)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(ConfigError, match="pip install s3fs"):
        plan_chunks([_spec("s3://bucket/d.jsonl")], rows_per_chunk=4, seed=0)


def test_an_object_replaced_between_tests_is_read_anew(s3):
    """The same key with other bytes in a later test (as in a full run) is not answered from memory."""
    from PIL import Image

    for colour in (7, 200):
        buf = io.BytesIO()
        Image.new("RGB", (33, 21), colour).save(buf, "JPEG")
        out = io.BytesIO()
        pq.write_table(pa.table({"images": [[{"bytes": buf.getvalue(), "path": "x.jpg"}]]}), out)
        s3.put_object(Bucket="bkt", Key="same.parquet", Body=out.getvalue())
        ref = MediaRef.table_cell("s3://bkt/same.parquet", 0, ("images", "0", "bytes"), "x.jpg")
        assert read_bytes(ref, LmdbPool()) == buf.getvalue(), colour
        _forget_cached_readers()  # what the s3 fixture does between two tests
