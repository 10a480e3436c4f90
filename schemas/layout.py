"""On-disk names shared by all stages: one place, so no stage guesses another's paths."""

from __future__ import annotations

MANIFEST_FILE = "manifest.json"
SAMPLES_DIR = "samples"
ERRORS_DIR = "errors"
PART_SUFFIX = ".arrow"
TMP_PREFIX = ".tmp-"


def part_name(part_index: int) -> str:
    """File name of one output part; zero-padded so lexical order is part order."""
    return f"part-{part_index:06d}{PART_SUFFIX}"


RUN_FILE = "_run.json"  # the options a stage's output depends on (resume check)
