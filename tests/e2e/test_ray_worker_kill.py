"""A Ray worker that dies mid-run (issue 29): the actor process running tokenize or shards tasks
is SIGKILLed after its first output (``PACKVLM_CRASH_AT`` inside the actor, as an OOM kill
would). The run either finishes byte-identical to a clean run (Ray retried the task) or stops
with one clear error line and the same command finishes it byte-identical. (Ray Data logs the
actor's death with its own traceback on stderr before that line.)

Truth: the clean run of `tests.e2e.test_fault_matrix` (same example, same output path).
"""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.test_fault_matrix import _pack, _prep, _tokenize, _tree, clean, example, work  # noqa: F401

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("crash_at", ["tokenize.after_part:1", "shards.after_shard:1"])
def test_a_killed_ray_worker_finishes_or_resumes_identically(example, clean, work, crash_at) -> None:  # noqa: F811
    shutil.rmtree(work)
    stage = crash_at.split(".")[0]
    if stage == "shards":  # tokenize first, cleanly: only the shards actor dies
        assert _prep(_tokenize(example, work / "tok"), None, "ray").returncode == 0
    steps = [_tokenize(example, work / "tok"), _pack(work / "tok", work / "packed")]
    first = _prep(steps[0] if stage == "tokenize" else steps[1], crash_at, "ray")
    assert first.returncode in (0, 1, 3, 4), first.stderr[-3000:]
    if first.returncode != 0:  # one error line saying what to do (Ray Data itself still logs the actor's death)
        lines = [line for line in first.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Ray failed mid-run" in lines[0], first.stderr[-3000:]
        assert "rerun to resume" in first.stderr
    for args in steps:
        done = _prep(args, None, "ray")
        assert done.returncode == 0, done.stderr[-3000:]
    assert _tree(work) == clean
