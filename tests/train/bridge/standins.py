"""Test-only stand-ins that let Megatron-Bridge 0.6.2 import on a CPU machine without its GPU stack.

Megatron-Bridge imports two GPU-only packages at module import on paths our tests cross:

- ``megatron/bridge/peft/lora_layers.py`` (reached from ``megatron.bridge``'s ``__init__``):
  ``import transformer_engine.pytorch as te``; the module then names ``te.ops.Sequential`` in
  annotations and ``te.Linear`` / ``te.LayerNormLinear`` in ``isinstance`` checks of LoRA layers
  (never reached here: no LoRA). Transformer Engine needs CUDA to build.
- ``megatron/bridge/training/pretrain.py`` (``finetune``'s module):
  ``from nvidia_resiliency_ext.inprocess import CallWrapper``, used only for the in-process
  restart wrapper (off by default). nvidia-resiliency-ext 0.6 wheels need glibc >= 2.39.

`install` adds an import hook that serves a ``transformer_engine`` stand-in **only to**
``megatron.bridge.peft.lora_layers`` and removes it from ``sys.modules`` right after, so that
megatron-core's own ``try: import transformer_engine`` checks keep failing and it keeps its
non-TE (local) layers; and a ``nvidia_resiliency_ext.inprocess`` stand-in holding a
``CallWrapper`` class. Neither stand-in has behaviour: a test that reached TE or NVRx code
would fail on a missing attribute, not pass. Nothing is installed where the real package imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


def _transformer_engine() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine")
    te.__path__ = []  # a package, so ``transformer_engine.pytorch`` resolves
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))  # type: ignore[attr-defined]
    pytorch.Linear = type("Linear", (), {})  # type: ignore[attr-defined]  # nothing is an instance of these
    pytorch.LayerNormLinear = type("LayerNormLinear", (), {})  # type: ignore[attr-defined]
    te.pytorch = pytorch  # type: ignore[attr-defined]
    return {"transformer_engine": te, "transformer_engine.pytorch": pytorch}


class _LoraLayersLoader(importlib.abc.Loader):
    """Runs the real ``lora_layers`` module with the TE stand-in visible for its own import only."""

    def __init__(self, real: importlib.machinery.ModuleSpec) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        # what lora_layers imports besides TE, first, so none of it is imported while the stand-in is visible
        for name in ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper"):
            importlib.import_module(name)
        importlib.import_module("megatron.bridge.peft.lora_merge")
        before = set(sys.modules)
        sys.modules.update(_transformer_engine())
        try:
            assert self.real.loader is not None
            self.real.loader.exec_module(module)  # type: ignore[union-attr]
        finally:
            for name in TE_NAMES:
                sys.modules.pop(name, None)
        leaked = set(sys.modules) - before - set(TE_NAMES) - {LORA_LAYERS}
        if leaked:  # Bridge changed what lora_layers imports: those modules may have seen the stand-in
            raise ImportError(f"modules imported while the transformer_engine stand-in was visible: {sorted(leaked)}")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != LORA_LAYERS:
            return None
        sys.meta_path.remove(self)
        try:
            real = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if real is None:
            return None
        spec = importlib.util.spec_from_file_location(name, real.origin, loader=_LoraLayersLoader(real))
        return spec


def _resiliency_ext() -> None:
    package = types.ModuleType("nvidia_resiliency_ext")
    package.__path__ = []
    inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    inprocess.CallWrapper = type("CallWrapper", (), {})  # type: ignore[attr-defined]  # only an annotation in 0.6.2
    package.inprocess = inprocess  # type: ignore[attr-defined]
    sys.modules.update({"nvidia_resiliency_ext": package, "nvidia_resiliency_ext.inprocess": inprocess})


def install() -> list[str]:
    """Install what is needed (before ``megatron.bridge`` is imported); returns what was stood in."""
    stood_in = []
    if importlib.util.find_spec("transformer_engine") is None and not any(
        isinstance(f, _Finder) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _Finder())
        stood_in.append("transformer_engine (for megatron.bridge.peft.lora_layers only)")
    if "nvidia_resiliency_ext" not in sys.modules and importlib.util.find_spec("nvidia_resiliency_ext") is None:
        _resiliency_ext()
        stood_in.append("nvidia_resiliency_ext.inprocess")
    return stood_in
