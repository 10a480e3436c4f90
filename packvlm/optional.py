"""Optional packages: one error class, so a missing one always ends with exit 3 and its install line.

Heavy or platform-bound dependencies (torchvision for video, flash-attn, flash-linear-attention,
peft, Megatron-Bridge, matplotlib for reports) are imported where a command first needs them.
When one is absent the command stops **before** it claims an output directory, with one line
naming the package, what needs it and the command that installs it::

    require_package("torchvision", purpose="video packs (the HF video processor)",
                    install="pip install torchvision  # the build matching your torch")
    -> MissingPackageError: video packs (the HF video processor) need torchvision, which is not
       installed: pip install torchvision  # the build matching your torch
"""

from __future__ import annotations

import importlib.util

from packvlm.errors import ResourceError


class MissingPackageError(ResourceError):
    """An optional package a command needs is not installed (exit 3); the message holds the install line.

    Not an ``ImportError``: Energon treats one raised in a loader worker as a system failure and
    re-raises it wrapped in the whole sample's repr, where this one line would be lost.
    """


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported; a missing parent package counts as missing, not an error."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # ValueError: a module with __spec__ None
        return False


def missing_package_message(package: str, *, purpose: str, install: str) -> str:
    """The one line every missing-package error uses: what needs it, then how to install it."""
    return f"{purpose} need {package}, which is not installed: {install}"


def require_package(module: str, *, purpose: str, install: str, package: str | None = None) -> None:
    """Raise `MissingPackageError` unless ``module`` is importable.

    Args:
        module: The import name, e.g. ``"torchvision"`` or ``"megatron.bridge"``.
        purpose: What needs it, plural, e.g. ``"video packs"``.
        install: The install command, e.g. ``"pip install 'packvlm[fla]'"``.
        package: The distribution name when it differs from ``module``.
    """
    if not is_installed(module):
        raise MissingPackageError(missing_package_message(package or module, purpose=purpose, install=install))
