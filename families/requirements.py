"""The transformers release a family needs: its processor and model classes ship only from some version on.

pyproject.toml allows transformers from 5.8; a family whose classes arrived later declares its first
release in `families.registry.Family.min_transformers` (Kimi K2.5: 5.13.0; Megatron-Bridge pins
<= 5.12.1). `prep example`, `prep tokenize` and `train` call `check_transformers` with the family
before any of its classes is imported, so the run ends with one line naming the family, the installed
version and the one needed (exit 3) instead of an ImportError deep inside transformers::

    check_transformers(family_of_example("kimi_k25"))
    -> TransformersVersionError: family kimi_k25 needs transformers>=5.13.0 (its classes ship from there);
       installed: 5.12.1: pip install "transformers>=5.13.0"
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

from families.registry import Family, family_of_processor
from packvlm.errors import ResourceError


class TransformersVersionError(ResourceError):
    """The installed transformers predates the classes a family needs; upgrade it (exit 3)."""


def installed_transformers() -> str:
    """The installed transformers' version (from its metadata: importing transformers takes seconds)."""
    try:
        return version("transformers")
    except PackageNotFoundError:  # not installed as a distribution (a source tree on sys.path)
        import transformers

        return str(transformers.__version__)


def check_transformers(family: Family | None) -> None:
    """Refuse a family whose ``min_transformers`` is newer than the installed transformers.

    Raises:
        TransformersVersionError: Names the family, the installed version and the one needed.
    """
    if family is None or family.min_transformers is None:
        return
    installed = installed_transformers()
    if Version(installed) < Version(family.min_transformers):
        raise TransformersVersionError(
            f"family {family.name} needs transformers>={family.min_transformers} (its classes ship from there); "
            f'installed: {installed}: pip install "transformers>={family.min_transformers}"'
        )


def check_processor_class(processor_class: str | None) -> None:
    """`check_transformers` for the family serving ``processor_class`` (no family: nothing to check)."""
    if processor_class:
        check_transformers(family_of_processor(processor_class))


# where a processor directory names its class, in the order transformers reads them
_CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def declared_processor_class(path: str) -> str | None:
    """The ``processor_class`` a local processor directory's JSON files declare, read without transformers.

    None for a hub id or a directory that declares none (its load then reports what is wrong).
    """
    root = Path(path).expanduser()
    for name in _CLASS_FILES:
        try:
            raw = json.loads((root / name).read_text("utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and isinstance(raw.get("processor_class"), str):
            return str(raw["processor_class"])
    return None
