"""One reader module per input format (the dataset spec's ``formatting``).

Importing the package imports every module in it, so each reader registers itself
(:func:`prep.sources.formats.base.register_format`); adding a format is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
