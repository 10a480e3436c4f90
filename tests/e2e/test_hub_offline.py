"""A hub id that cannot load fails at once with one line (issue 10), instead of ~2.5 min of
huggingface_hub retries (5 per file, backoff 1+2+4+8+8 s) before any message.

The hub is made unreachable in-process: ``huggingface_hub.constants.ENDPOINT`` points at a
closed local port (connection refused), or ``HF_HUB_OFFLINE`` is set; nothing leaves the machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from huggingface_hub import constants

from prep.cli import main

FAST_S = 5.0  # the retries alone take > 20 s per file


def _closed_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again when the block ends


def _tokenize(example_dir: Path, out: Path, processor: str) -> tuple[float, Result]:
    args = ["tokenize", "--dataset-config", str(example_dir / "dataset_info.json"), "--processor", processor]
    args += ["--output", str(out), "--executor", "local"]
    start = time.monotonic()
    result = CliRunner().invoke(main, args)
    return time.monotonic() - start, result


def test_unreachable_hub_is_one_line_at_once(example_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port())
    seconds, result = _tokenize(example_dir, tmp_path / "tok", "not/a-real-repo")
    assert result.exit_code == 2, result.output
    assert "'not/a-real-repo': no such local directory" in result.output
    assert "does not answer" in result.output and constants.ENDPOINT in result.output
    assert "Traceback" not in result.output and "Retrying" not in result.output
    assert seconds < FAST_S, f"{seconds:.1f} s"
    assert not (tmp_path / "tok").exists()


def test_hf_hub_offline_is_one_line_at_once(example_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    seconds, result = _tokenize(example_dir, tmp_path / "tok", "not/a-real-repo")
    assert result.exit_code == 2, result.output
    assert "HF_HUB_OFFLINE" in result.output and "no copy of it" in result.output
    assert seconds < FAST_S, f"{seconds:.1f} s"
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("spelling", ["{p}", "{p}/"])
def test_a_local_directory_never_touches_the_hub(example_dir, tmp_path, monkeypatch, spelling) -> None:
    """The probe is for hub ids only: a processor directory loads with the hub unreachable."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port())
    from families.processor import load_processor

    bundle = load_processor(spelling.format(p=example_dir / "processor"))
    assert bundle.processor_class
