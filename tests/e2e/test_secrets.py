"""Secrets (issue 29): credentials given to an S3 source never reach an output byte.

Distinctive values are planted as the access key id, secret key and session token of a run that
reads its dataset from a local S3 server (moto, 127.0.0.1) with ``-v`` (the SDKs log request
headers at DEBUG); the run has error rows, and goes on through `prep errors`, `prep stats`
(report), `prep pack` and `prep energon-index`. Every byte of every file written under the
test's folder, and everything printed, is searched for each secret as it is, URL-quoted and
base64-encoded. A dataset URL carrying credentials is refused, without echoing them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.e2e.test_hostile_inputs import _entry, _row

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAPLANTEDK3YID0029",
    "AWS_SECRET_ACCESS_KEY": "pl4ntedSecretKey/29+xQzVb7Lm0Nn",
    "AWS_SESSION_TOKEN": "PlantedSessionToken29//AbCdEfGh+IjKl==",
}
URL_SECRET = "PlantedUrlPassword29"


def _forms(secret: str) -> set[bytes]:
    raw = secret.encode()
    return {raw, quote(secret, safe="").encode(), base64.b64encode(raw).rstrip(b"=")}


def _leaks(blob: bytes, secrets: list[str]) -> list[str]:
    return [s for s in secrets if any(form in blob for form in _forms(s))]


@pytest.fixture()
def s3_server():
    """A moto S3 server on 127.0.0.1 with bucket ``bkt``; yields its endpoint URL."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=SECRETS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=SECRETS["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=SECRETS["AWS_SESSION_TOKEN"],
    )
    client.create_bucket(Bucket="bkt")
    yield client, endpoint
    server.stop()


RUN = """
import sys
from prep.cli import main
for args in {commands!r}:
    try:
        main(args, standalone_mode=False)
    except SystemExit:
        pass
    except Exception as exc:  # a command's failure is output too: print it as the CLI would
        print(f"error: {{exc}}", file=sys.stderr)
"""


def _run_prep(commands: list[list[str]], env: dict[str, str]) -> tuple[int, str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **env}
    done = subprocess.run(
        [sys.executable, "-c", RUN.format(commands=commands)], capture_output=True, env=full, timeout=600
    )
    return done.returncode, (done.stdout + done.stderr).decode("utf-8", "replace")


def test_planted_credentials_appear_in_no_output_byte(s3_server, processor_dirs, tmp_path) -> None:
    client, endpoint = s3_server
    rows = [_row(None, f"hello {i}") for i in range(6)] + [_row("missing.png", "no such image")]
    body = "".join(json.dumps(r) + "\n" for r in rows) + "{not json\n"
    client.put_object(Bucket="bkt", Key="d.jsonl", Body=body.encode())
    work = tmp_path / "work"
    (work / "media").mkdir(parents=True)
    entry = {**_entry("unused"), "cloud_file_name": "s3://bkt/d.jsonl"}
    del entry["file_name"]
    (work / "dataset_info.json").write_text(json.dumps({"s3data": entry}))
    tok, packed = work / "tok", work / "packed"
    commands = [
        ["-v", "tokenize", "--dataset-config", str(work / "dataset_info.json"), "--processor"]
        + [str(processor_dirs["qwen2_vl"]), "--output", str(tok), "--executor", "local", "--max-error-rate", "1"],
        ["-v", "errors", str(tok)],
        ["-v", "stats", str(tok), "--output", str(work / "report")],
        ["-v", "pack", str(tok), "--output", str(packed), "--pack-size", "256", "--executor", "local"],
        ["-v", "energon-index", str(packed)],
    ]
    code, printed = _run_prep(commands, {**SECRETS, "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"})
    assert code == 0, printed[-3000:]
    # the run did what it is meant to: read S3, wrote error rows and every stage's output
    assert "missing_media" in printed and "malformed_json" in printed, printed[-3000:]
    written = [p for p in work.rglob("*") if p.is_file()]
    names = {p.name for p in written}
    assert {"manifest.json", "_run.json", "shards.json", "dataset.yaml"} <= names, sorted(names)
    assert any(p.suffix == ".html" for p in written) and any("errors" in p.parts for p in written)
    assert "DEBUG" in printed  # -v was on: debug lines were written, and searched
    secrets = list(SECRETS.values())
    assert _leaks(printed.encode(), secrets) == [], "printed"
    for path in written:
        assert _leaks(path.read_bytes(), secrets) == [], path


def test_a_dataset_url_with_credentials_is_refused_without_echoing_them(tmp_path, processor_dirs) -> None:
    work = tmp_path / "work"
    (work / "media").mkdir(parents=True)
    url = f"s3://{SECRETS['AWS_ACCESS_KEY_ID']}:{URL_SECRET}@bkt/d.jsonl"
    entry = {**_entry("unused"), "cloud_file_name": url}
    del entry["file_name"]
    (work / "dataset_info.json").write_text(json.dumps({"s3data": entry}))
    out = work / "tok"
    cmd = ["tokenize", "--dataset-config", str(work / "dataset_info.json"), "--processor"]
    cmd += [str(processor_dirs["qwen2_vl"]), "--output", str(out), "--executor", "local"]
    code, printed = _run_prep([cmd], {})
    assert "cloud_file_name carries credentials" in printed, printed[-2000:]
    assert _leaks(printed.encode(), [URL_SECRET, SECRETS["AWS_ACCESS_KEY_ID"]]) == []
    assert not out.exists() or all(_leaks(p.read_bytes(), [URL_SECRET]) == [] for p in out.rglob("*") if p.is_file())
