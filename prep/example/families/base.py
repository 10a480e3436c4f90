"""What an example family provides, and the registry ``prep example --family`` reads.

An example family writes a weightless processor directory that the real HF processor class
loads offline: a small BPE carrying the family's real special tokens, its chat template and
the image settings of a published checkpoint (named in ``description``), and a tiny random-init
model config of the family's real model class that accepts that processor's output
(:class:`prep.example.model.TinyModel`; ``tests/example/test_models_all_families.py`` walks the
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
    # writes a tiny model config for `train` from (model_dir, processor_dir): a prep.example.model.TinyModel
    build_model: Callable[[Path, Path], Path] | None = None


_REGISTRY: dict[str, ExampleFamily] = {}


def register_example_family(family: ExampleFamily) -> ExampleFamily:
    """Make ``family`` available to ``prep example --family`` (a name registers once)."""
    if family.name in _REGISTRY and _REGISTRY[family.name] != family:
        raise ValueError(f"example family {family.name!r} registered twice")
    _REGISTRY[family.name] = family
    return family


def example_families() -> tuple[str, ...]:
    """Registered family names, sorted (the choices of ``--family``)."""
    import prep.example.families  # noqa: F401  (registers every module)

    return tuple(sorted(_REGISTRY))


def example_family(name: str) -> ExampleFamily:
    """The registered family ``name``; a ValueError lists the choices."""
    names = example_families()
    if name not in _REGISTRY:
        raise ValueError(f"unknown example family {name!r}; choose one of {', '.join(names)}")
    return _REGISTRY[name]


def write_json(path: Path, payload: dict[str, Any], *, ensure_ascii: bool = True) -> None:
    """Indented, key-sorted JSON and a newline: a processor directory is the same bytes on every build."""
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=ensure_ascii) + "\n", "utf-8")
