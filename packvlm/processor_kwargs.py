"""What a transformers processor passes its image processor at call time, on transformers 5.8 to 5.24.

A processor call merges, per modality, its class's defaults, the tokenizer's init kwargs and
the caller's kwargs (``ProcessorMixin._merge_kwargs``) before it calls the image processor;
those class defaults override ``preprocessor_config.json`` (InternVL's ``crop_to_patches``,
Gemma 3's pan-and-scan), so a counter that reads the image processor alone counts wrong.

transformers has no public accessor for the merged values, and where the class declares them
moved inside the range packvlm supports:

============  ==================================================  ===============================
version       class defaults                                      ``_merge_kwargs`` first argument
============  ==================================================  ===============================
5.8 - 5.12    ``<Model>ProcessorKwargs._defaults`` (the type of   required; ``valid_processor_kwargs``
              ``__call__``'s ``**kwargs: Unpack[...]``)           names it only for some classes
5.2x          the processor's ``images_kwargs`` attribute, then   optional (``valid_processor_kwargs``)
              any ``_defaults`` left
============  ==================================================  ===============================

So this module is the one place packvlm calls that private method, always with the kwargs
class passed explicitly (accepted by every version), and says what to do when a future
transformers changes it.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from packvlm.errors import ResourceError

SUPPORTED = "transformers>=5.8,<5.25"  # pyproject.toml


class ProcessorApiError(ResourceError):
    """The installed transformers merges processor kwargs in a way packvlm does not know."""


def processor_kwargs_class(processor_class: type) -> type:
    """The ``ProcessingKwargs`` TypedDict ``processor_class.__call__`` merges its kwargs with.

    Its own ``valid_processor_kwargs`` where the class sets one, else the type its ``__call__``
    declares for ``**kwargs`` (5.8 - 5.12 declare ``Unpack[<Model>ProcessorKwargs]`` there),
    else transformers' base ``ProcessingKwargs``.
    """
    from transformers.processing_utils import ProcessingKwargs

    declared = getattr(processor_class, "valid_processor_kwargs", None)
    if isinstance(declared, type) and declared is not ProcessingKwargs:
        return declared
    try:  # eval_str: a processor module with `from __future__ import annotations` holds strings
        parameter = inspect.signature(processor_class.__call__, eval_str=True).parameters.get("kwargs")
    except (NameError, TypeError, ValueError):
        parameter = None
    args = typing.get_args(None if parameter is None else parameter.annotation)
    if args and isinstance(args[0], type) and hasattr(args[0], "__annotations__"):
        return args[0]
    return ProcessingKwargs


def call_images_kwargs(processor: Any) -> dict[str, Any]:
    """The ``images_kwargs`` ``processor`` passes its image processor on a call with no kwargs of the caller.

    Raises:
        ProcessorApiError: the installed transformers' ``_merge_kwargs`` takes other arguments.
    """
    kwargs_class = processor_kwargs_class(type(processor))
    tokenizer = getattr(processor, "tokenizer", None)
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    try:
        merged = processor._merge_kwargs(kwargs_class, tokenizer_init_kwargs=init_kwargs)
        return dict(merged["images_kwargs"])
    except (AttributeError, TypeError, KeyError) as exc:
        raise ProcessorApiError(_unsupported(f"{type(processor).__name__} kwargs could not be merged ({exc})")) from exc


def class_images_kwargs(processor_class: type | None) -> dict[str, Any]:
    """The image defaults ``processor_class`` declares, for when no instance could be built.

    The same precedence as a call: the class's ``images_kwargs`` attribute (5.2x), overridden by
    its kwargs class's ``_defaults`` (5.8 - 5.12, still honoured later).
    """
    if processor_class is None:
        return {}
    attribute = getattr(processor_class, "images_kwargs", None)
    defaults = getattr(processor_kwargs_class(processor_class), "_defaults", None) or {}
    return {**(attribute if isinstance(attribute, dict) else {}), **defaults.get("images_kwargs", {})}


def _unsupported(what: str) -> str:
    import transformers

    return f"{what}: transformers {transformers.__version__} is outside the tested {SUPPORTED}; install a version in it"
