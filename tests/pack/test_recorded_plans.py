"""The memory-lean packer (issue 21) gives the same plans as the version before it, value for value."""

from __future__ import annotations

import json

import pytest

from prep.pack.core import plan_packs
from tests.pack.recorded_plans import NUM_CASES, RECORDING, case, digest

RECORDED = json.loads(RECORDING.read_text())


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_plan_equals_the_recorded_plan(index: int) -> None:
    assert digest(plan_packs(**case(index))) == RECORDED[index]
