"""What a family's offline example provides (``prep example --family``, tests and benchmarks).

An example family writes a weightless processor directory that the real HF processor class
loads offline: a small BPE carrying the family's real special tokens, its chat template and
the image settings of a published checkpoint (named in ``description``), and a tiny random-init
model config of the family's real model class that accepts that processor's output
(:class:`families.example.model.TinyModel`; ``tests/example/test_models_all_families.py`` walks the
registry and fails for a family without one).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class ExampleFamily:
    name: str
    build_processor: Callable[[Path], Path]  # writes the processor directory, returns it
    description: str  # which checkpoint's settings the processor carries
    # writes a tiny model config for `train` from (model_dir, processor_dir): a families.example.model.TinyModel
    build_model: Callable[[Path, Path], Path] | None = None


def write_json(path: Path, payload: dict[str, Any], *, ensure_ascii: bool = True) -> None:
    """Indented, key-sorted JSON and a newline: a processor directory is the same bytes on every build."""
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=ensure_ascii) + "\n", "utf-8")
