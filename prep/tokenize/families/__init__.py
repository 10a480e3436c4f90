"""One closed-form media counter per model family.

Importing the package imports every module in it, so each counter registers itself
(:func:`prep.tokenize.families.base.register_counter`); adding a family is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
