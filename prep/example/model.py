"""The tiny model config of an example family by name (``prep example``, tests, benchmarks).

The configs themselves are the families' (:class:`families.example.model.TinyModel`, each
family's ``families/<name>/example.py``); this looks one up in `families.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from families.example.model import TinyModel, name_architecture, read_processor_facts
from families.registry import example_family

if TYPE_CHECKING:  # transformers is imported on use: `prep --help` stays fast
    from transformers import PretrainedConfig


def _tiny_model(family: str) -> TinyModel:
    build = example_family(family).build_model
    if not isinstance(build, TinyModel):
        raise ValueError(f"example family {family!r} registers no tiny model config")
    return build


def tiny_model_config(family: str, processor_dir: str | Path) -> PretrainedConfig:
    """The small random-init config of example ``family`` that accepts ``processor_dir``'s inputs.

    Args:
        family: A registered example family (``prep example --family`` choices).
        processor_dir: Its processor directory (the family's ``build_processor`` output).

    Returns:
        The config; ``AutoModelForImageTextToText.from_config`` builds the model.
    """
    return name_architecture(_tiny_model(family).config(read_processor_facts(processor_dir)))


def write_tiny_model(out_dir: str | Path, family: str, processor_dir: str | Path) -> Path:
    """Write ``family``'s tiny ``config.json`` and ``generation_config.json`` (no weights) to ``out_dir``.

    ``AutoConfig.from_pretrained(out_dir)`` loads it; ``train.models.load_model(out_dir, seed=...)``
    initialises the weights at random. Same arguments give the same bytes.
    """
    return _tiny_model(family)(Path(out_dir), Path(processor_dir))
