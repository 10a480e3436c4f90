"""The processors' own video arithmetic, loaded on a machine without torchvision.

``video_processing_qwen2_vl`` imports torchvision at module level only for resize kernels;
its frame sampling and patch counting are plain Python/torch. We import the module with a
throw-away torchvision stub (removed again right after) so the tests compare our closed
form against transformers' own functions, not against a re-implementation.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import transformers  # noqa: F401  (import first: its availability checks must see no torchvision)
import transformers.models.qwen2_vl as qwen2_vl_pkg

_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")


def load_qwen2_video_module() -> types.ModuleType:
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    if isinstance(sys.modules.get(name), types.ModuleType) and hasattr(sys.modules[name], "smart_resize"):
        return sys.modules[name]
    stubs = {n: types.ModuleType(n) for n in _STUBS}
    for parent, child in zip(_STUBS, _STUBS[1:]):
        setattr(stubs[parent], child.rsplit(".", 1)[1], stubs[child])
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, f"{qwen2_vl_pkg.__path__[0]}/video_processing_qwen2_vl.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        for n in _STUBS:
            sys.modules.pop(n, None)
    return module
