"""Example processors per model family, for ``prep example --family`` and the benchmarks.

Importing the package imports every module in it, so each family registers itself
(:func:`prep.example.families.base.register_example_family`); adding one is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
