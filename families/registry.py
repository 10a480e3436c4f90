"""Every model family, listed once: the processor classes it serves and the names of its faces.

A family's faces live in its folder ``families/<name>/``: the counter (``counter.py``, what
`prep tokenize` counts with), the layout (``layout.py``, how `train` builds the vision
inputs) and the offline examples (``example.py``'s ``EXAMPLES``, what ``prep example
--family`` writes). `prep` and `train` find a family here by the processor class a processor
directory loads as, or by an example's name.

Faces are named here and imported on first use: importing every family brings in torch and
many transformers modules, which ``prep --help`` and ``prep example`` do not need.
``tests/families/test_registry.py`` imports them all and fails when a face is missing or two
keys disagree.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the faces' bases import torch and transformers: only on use
    from families.counter import CounterClass, CounterFactory
    from families.example.base import ExampleFamily
    from families.layout import LayoutClass

Face = str  # "counter", "layout" or "example": the module of the family's folder


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One model family: its folder, the processor classes it serves, and its faces by name."""

    name: str  # the folder families/<name>/
    processor_classes: tuple[str, ...]  # HF processor class names (what `load_processor` reports)
    counter: str  # class in families/<name>/counter.py
    layout: str  # class in families/<name>/layout.py
    examples: tuple[str, ...]  # names of families/<name>/example.py's EXAMPLES (``prep example --family``)
    #: its image processor exists only in torchvision form: counting works without torchvision
    #: (settings only), building pixels (train, verifying against the processor) needs it
    needs_torchvision: bool = False
    #: the first transformers release shipping its classes; None: any release pyproject.toml allows
    #: (`prep` and `train` refuse an older one up front: families/requirements.py)
    min_transformers: str | None = None

    def module(self, face: Face) -> ModuleType:
        """``families.<name>.<face>``, imported."""
        return importlib.import_module(f"{__package__}.{self.name}.{face}")

    def counter_class(self) -> CounterClass:
        """The counter class (``from_processor`` builds it from the loaded processor)."""
        cls: CounterClass = getattr(self.module("counter"), self.counter)
        return cls

    def layout_class(self) -> LayoutClass:
        """The layout class (``from_bundle`` builds it from the loaded processor)."""
        cls: LayoutClass = getattr(self.module("layout"), self.layout)
        return cls

    def example(self, name: str) -> ExampleFamily:
        """The example ``name`` of ``example.py``'s ``EXAMPLES``."""
        found = [e for e in self.module("example").EXAMPLES if e.name == name]
        if len(found) != 1:
            raise LookupError(f"families/{self.name}/example.py defines {len(found)} examples named {name!r}")
        return found[0]


FAMILIES: tuple[Family, ...] = (
    Family(
        name="qwen2_vl",
        processor_classes=("Qwen2VLProcessor", "Qwen2_5_VLProcessor"),
        counter="Qwen2VLCounter",
        layout="Qwen2VLLayout",
        examples=("qwen2_vl", "qwen2_5_vl"),
    ),
    Family(
        name="qwen3_vl",
        processor_classes=("Qwen3VLProcessor",),
        counter="Qwen3VLCounter",
        layout="Qwen3VLLayout",
        examples=("qwen3_vl", "qwen3_5"),
    ),
    Family(
        name="qwen_omni",
        processor_classes=("Qwen2_5OmniProcessor", "Qwen3OmniMoeProcessor"),
        counter="QwenOmniCounter",
        layout="QwenOmniLayout",
        examples=("qwen2_5_omni", "qwen3_omni_moe"),
    ),
    Family(
        name="glm4v",
        processor_classes=("Glm4vProcessor", "Glm46VProcessor"),
        counter="Glm4vCounter",
        layout="Glm4vLayout",
        examples=("glm4v", "glm46v"),
    ),
    Family(
        name="internvl",
        processor_classes=("InternVLProcessor",),
        counter="InternVLCounter",
        layout="InternVLLayout",
        examples=("internvl",),
    ),
    Family(
        name="gemma3",
        processor_classes=("Gemma3Processor",),
        counter="Gemma3Counter",
        layout="Gemma3Layout",
        examples=("gemma3",),
    ),
    Family(
        name="gemma4",
        processor_classes=("Gemma4Processor",),
        counter="Gemma4Counter",
        layout="Gemma4Layout",
        examples=("gemma4",),
    ),
    Family(
        name="pixtral",
        processor_classes=("PixtralProcessor", "Mistral3Processor"),
        counter="PixtralCounter",
        layout="PixtralLayout",
        examples=("pixtral", "mistral3"),
    ),
    Family(
        name="idefics3",
        processor_classes=("Idefics3Processor", "SmolVLMProcessor"),
        counter="Idefics3Counter",
        layout="Idefics3Layout",
        examples=("idefics3", "smolvlm"),
    ),
    Family(
        name="llava",
        processor_classes=("LlavaNextProcessor", "LlavaOnevisionProcessor"),
        counter="LlavaCounter",
        layout="LlavaLayout",
        examples=("llava_onevision", "llava_next"),
    ),
    Family(
        name="paddleocr_vl",
        processor_classes=("PaddleOCRVLProcessor",),
        counter="PaddleOCRVLCounter",
        layout="PaddleOCRVLLayout",
        examples=("paddleocr_vl",),
    ),
    Family(
        name="lfm2_vl",
        processor_classes=("Lfm2VlProcessor",),
        counter="Lfm2VlCounter",
        layout="Lfm2VlLayout",
        examples=("lfm2_vl",),
        needs_torchvision=True,
    ),
    Family(
        name="kimi_k25",
        processor_classes=("Kimi_K25Processor",),
        counter="KimiK25Counter",
        layout="KimiK25Layout",
        examples=("kimi_k25",),
        needs_torchvision=True,
        min_transformers="5.13.0",  # models/kimi_k25 is absent from the 5.12.1 wheel, present in 5.13.0's
    ),
    Family(
        name="minicpmv4_6",
        processor_classes=("MiniCPMV4_6Processor",),
        counter="MiniCPMV4_6Counter",
        layout="MiniCPMV4_6Layout",
        examples=("minicpmv4_6",),
    ),
)


def family_of_processor(processor_class: str) -> Family | None:
    """The family serving ``processor_class``, or None (no closed-form counter, no training layout)."""
    found = [f for f in FAMILIES if processor_class in f.processor_classes]
    return found[0] if found else None


def find_counter(processor_class: str) -> CounterFactory | None:
    """The counter factory for a processor class, or None (count with the processor itself)."""
    family = family_of_processor(processor_class)
    return None if family is None else family.counter_class().from_processor


def counter_image_attention(processor_class: str) -> str:
    """``image_attention`` of the counter serving ``processor_class`` ("causal" without one)."""
    from families.counter import image_attention

    family = family_of_processor(processor_class)
    return "causal" if family is None else image_attention(family.counter_class())


def find_layout(processor_class: str) -> LayoutClass | None:
    """The layout class serving ``processor_class``, or None (the family cannot train)."""
    family = family_of_processor(processor_class)
    return None if family is None else family.layout_class()


def example_families() -> tuple[str, ...]:
    """Every example's name, sorted (the choices of ``prep example --family``)."""
    return tuple(sorted(name for f in FAMILIES for name in f.examples))


def family_of_example(name: str) -> Family:
    """The family whose examples include ``name``; a ValueError lists the choices."""
    for family in FAMILIES:
        if name in family.examples:
            return family
    raise ValueError(f"unknown example family {name!r}; choose one of {', '.join(example_families())}")


def example_family(name: str) -> ExampleFamily:
    """The example ``name`` (its processor directory writer and tiny model); a ValueError lists the choices."""
    return family_of_example(name).example(name)
