"""The one family registry against the family folders: every face present, every key agreeing.

Oracles: the folders on disk (``families/<name>/``), the classes and examples the faces define,
and the processor class each example's processor directory declares (what `load_processor`
reports for it). ``problems`` is run on the real registry (no problem) and on broken copies
(each breakage named), so the check itself is shown to fail.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

import families
from families.example.model import TinyModel
from families.registry import FAMILIES, Family, example_families, example_family, family_of_processor

ROOT = Path(families.__file__).parent
FACES = ("counter", "layout", "example")
COUNTER_METHODS = ("from_processor", "count_image", "count_video", "processor_video_kwargs")
LAYOUT_METHODS = ("from_bundle", "sample_inputs")


def _face_problems(family: Family) -> list[str]:
    out = []
    for face in FACES:
        if not (ROOT / family.name / f"{face}.py").is_file():
            return [f"{family.name}: no families/{family.name}/{face}.py"]
    for face, name, methods in (
        ("counter", family.counter, COUNTER_METHODS),
        ("layout", family.layout, LAYOUT_METHODS),
    ):
        cls = getattr(family.module(face), name, None)
        if cls is None:
            out.append(f"{family.name}: families/{family.name}/{face}.py has no {name}")
            continue
        if cls.__module__ != f"families.{family.name}.{face}":
            out.append(f"{family.name}: {face} {name} is defined in {cls.__module__}, not in the family's folder")
        out += [f"{family.name}: {face} {name} lacks {m}" for m in methods if not callable(getattr(cls, m, None))]
    examples = getattr(family.module("example"), "EXAMPLES", ())
    defined = [e.name for e in examples]
    out += [
        f"{family.name}: example {e.name} has no tiny model"
        for e in examples
        if not isinstance(e.build_model, TinyModel)
    ]
    if not family.examples:
        out.append(f"{family.name}: no example")
    if sorted(defined) != sorted(family.examples):
        out.append(f"{family.name}: example.py defines {sorted(defined)}, the registry lists {sorted(family.examples)}")
    return out


def problems(registry: tuple[Family, ...]) -> list[str]:
    """Everything wrong with ``registry``: missing faces, keys claimed twice, folders not listed."""
    out = []
    for key, values in (
        ("family name", [f.name for f in registry]),
        ("processor class", [c for f in registry for c in f.processor_classes]),
        ("example name", [e for f in registry for e in f.examples]),
    ):
        out += [f"{key} {v!r} is claimed by {n} families" for v, n in Counter(values).items() if n > 1]
    out += [f"{f.name}: serves no processor class" for f in registry if not f.processor_classes]
    folders = {p.parent.name for face in FACES for p in ROOT.glob(f"*/{face}.py")}
    out += [f"families/{name}/ is not in the registry" for name in sorted(folders - {f.name for f in registry})]
    for family in registry:
        out += _face_problems(family)
    return out


def test_every_family_has_every_face_and_no_key_is_claimed_twice() -> None:
    assert problems(FAMILIES) == []


@pytest.mark.parametrize(
    ("broken", "expected"),
    [
        (lambda f: dataclasses.replace(f, layout="NoSuchLayout"), "has no NoSuchLayout"),
        (lambda f: dataclasses.replace(f, counter="MediaCount"), "defined in families.counter"),
        (lambda f: dataclasses.replace(f, examples=(*f.examples, "extra")), "the registry lists"),
        (lambda f: dataclasses.replace(f, examples=()), "no example"),
        (lambda f: dataclasses.replace(f, name="no_such_folder"), "no families/no_such_folder/counter.py"),
        (lambda f: dataclasses.replace(f, processor_classes=()), "serves no processor class"),
        (lambda f: dataclasses.replace(f, name="gemma3"), "example.py defines ['gemma3']"),
    ],
)
def test_a_broken_registry_line_is_named(broken, expected: str) -> None:
    registry = (broken(FAMILIES[0]), *FAMILIES[1:])
    assert any(expected in p for p in problems(registry)), problems(registry)


def test_a_key_claimed_twice_or_a_folder_left_out_is_named() -> None:
    first, second = FAMILIES[0], FAMILIES[1]
    twice = (
        first,
        dataclasses.replace(second, processor_classes=(*second.processor_classes, first.processor_classes[0])),
    )
    assert f"processor class {first.processor_classes[0]!r} is claimed by 2 families" in problems(twice + FAMILIES[2:])
    assert f"families/{first.name}/ is not in the registry" in problems(FAMILIES[1:])


@pytest.mark.parametrize("name", example_families())
def test_each_example_writes_a_processor_of_its_family(tmp_path: Path, name: str) -> None:
    """The class an example's directory declares is one its family serves (what `load_processor` reports)."""
    out = example_family(name).build_processor(tmp_path)
    declared = {
        json.loads((out / file).read_text()).get("processor_class")
        for file in ("processor_config.json", "preprocessor_config.json")
        if (out / file).is_file()
    } - {None}
    assert len(declared) == 1, declared
    (processor_class,) = declared
    family = family_of_processor(processor_class)
    assert family is not None and name in family.examples, (name, processor_class)


def test_lookups_by_processor_class_and_example_name() -> None:
    from families.gemma3.counter import Gemma3Counter
    from families.gemma3.layout import Gemma3Layout
    from families.registry import counter_image_attention, find_counter, find_layout

    assert find_counter("Gemma3Processor") == Gemma3Counter.from_processor
    assert find_layout("Gemma3Processor") is Gemma3Layout
    assert counter_image_attention("Gemma3Processor") == "bidirectional"
    assert (find_counter("NoSuchProcessor"), find_layout("NoSuchProcessor")) == (None, None)
    assert counter_image_attention("NoSuchProcessor") == "causal"
    with pytest.raises(ValueError, match="choose one of"):
        example_family("no_such_example")


def test_an_example_without_a_tiny_model_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    (gemma3,) = [f for f in FAMILIES if f.name == "gemma3"]
    module = gemma3.module("example")
    monkeypatch.setattr(module, "EXAMPLES", tuple(dataclasses.replace(e, build_model=None) for e in module.EXAMPLES))
    assert "gemma3: example gemma3 has no tiny model" in problems(FAMILIES)
