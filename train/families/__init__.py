"""One training layout per model family: how stored media become the model's vision inputs.

Importing the package imports every module in it, so each layout registers itself
(:func:`train.families.base.register_layout`), keyed by processor class like the counters of
`prep.tokenize.families`; adding a family is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
