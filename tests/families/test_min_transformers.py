"""A family's minimum transformers (``Family.min_transformers``): true of the installed release, and
`prep example`, `prep tokenize` and `train` refuse an older one up front, in one line (exit 3).

Truth: the installed transformers' own exports (a family's processor classes exist iff the installed
release is at least its minimum); the refusals are driven by patching the installed version (and, for
the paths that need a tokenized dataset, the Qwen2-VL example's declared minimum), and in the
transformers 5.12.1 environment of `.ci/compat-env` by the real one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.version import Version

from families import registry
from families.registry import FAMILIES
from families.requirements import (
    TransformersVersionError,
    check_transformers,
    declared_processor_class,
    installed_transformers,
)
from packvlm.errors import ExitCode
from prep.cli import main as prep_main

OLD = "5.12.1"  # Megatron-Bridge 0.6.2's pin: no Kimi K2.5 classes


def _too_old(family: registry.Family) -> bool:
    return family.min_transformers is not None and Version(installed_transformers()) < Version(family.min_transformers)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_the_declared_minimum_is_true_of_the_installed_transformers(family: registry.Family) -> None:
    """Families at or above their minimum have their processor classes; those below have none and are refused."""
    import transformers

    exported = set(dir(transformers))  # the lazy module's names: hasattr would import torchvision-gated modules
    present = [c for c in family.processor_classes if c in exported]
    if _too_old(family):
        assert present == [], f"{family.name}: {present} exist in {installed_transformers()}: lower min_transformers"
        with pytest.raises(TransformersVersionError, match=f"family {family.name} needs transformers>="):
            check_transformers(family)
    else:
        assert present, f"{family.name}: none of {family.processor_classes} in transformers {installed_transformers()}"
        check_transformers(family)


def test_prep_example_refuses_an_older_transformers_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("families.requirements.installed_transformers", lambda: OLD)
    result = CliRunner().invoke(prep_main, ["example", str(tmp_path / "ex"), "--family", "kimi_k25"])
    assert result.exit_code == ExitCode.RESOURCE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "family kimi_k25 needs transformers>=5.13.0" in lines[0] and f"installed: {OLD}" in lines[0]
    assert not (tmp_path / "ex" / "processor").exists()  # refused before writing


def _qwen_needs_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed transformers reads as 5.12.1 and Qwen2-VL (the conftest example) as needing 5.13.0."""
    families = tuple(dataclasses.replace(f, min_transformers="5.13.0") if f.name == "qwen2_vl" else f for f in FAMILIES)
    monkeypatch.setattr(registry, "FAMILIES", families)
    monkeypatch.setattr("families.requirements.installed_transformers", lambda: OLD)


def test_prep_tokenize_refuses_before_loading_the_processor(example_dir: Path, tmp_path: Path, monkeypatch) -> None:
    _qwen_needs_newer(monkeypatch)
    assert declared_processor_class(str(example_dir / "processor")) == "Qwen2VLProcessor"

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("AutoProcessor loaded despite the version check")

    monkeypatch.setattr("families.processor.AutoProcessor.from_pretrained", no_load)
    args = ["--dataset-config", str(example_dir / "dataset_info.json"), "--processor", str(example_dir / "processor")]
    result = CliRunner().invoke(prep_main, ["tokenize", *args, "--output", str(tmp_path / "t"), "--executor", "local"])
    assert result.exit_code == ExitCode.RESOURCE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "family qwen2_vl needs transformers>=5.13.0" in lines[0], result.output
    assert f"installed: {OLD}" in lines[0]


def test_train_refuses_data_of_a_family_newer_than_transformers(
    example_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch
) -> None:
    """`open_packed_dataset` (what `train hf` and `train megatron` run before building anything) checks the
    family the data was tokenized with, even without ``--processor``."""
    from prep.energon.index import index_dataset
    from tests.shards.oracles import pack, tokenized_dir
    from train.dataset import open_packed_dataset

    out = tmp_path_factory.mktemp("min_tf") / "packed"
    pack([tokenized_dir(example_dir, tmp_path_factory)], out)
    index_dataset(out)
    open_packed_dataset(out)  # the real version: accepted
    _qwen_needs_newer(monkeypatch)
    with pytest.raises(TransformersVersionError, match=f"family qwen2_vl needs transformers>=5.13.0.*installed: {OLD}"):
        open_packed_dataset(out)
    with pytest.raises(TransformersVersionError):
        open_packed_dataset(out, processor=str(example_dir / "processor"))
