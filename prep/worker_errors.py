"""Errors a stage's workers raise about their inputs, recoverable across Ray's wrapping.

Ray Data re-raises a worker's exception as ``UserCodeException`` whose cause does not survive
the trip; the remote traceback text does. Every subclass of `WorkerInputError` is registered
by name, so `unwrap_worker_error` can re-create ours with its own message.
"""

from __future__ import annotations

import re
from typing import ClassVar

from schemas.tokenized import TokenizedPartError


class WorkerInputError(RuntimeError):
    """An input problem found inside a worker (missing part, vanished media): the message says what to do."""

    registry: ClassVar[dict[str, type[WorkerInputError]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        WorkerInputError.registry[cls.__name__] = cls


# Input errors declared in schemas/ (which cannot import prep) join the registry here.
_FOREIGN: dict[str, type[Exception]] = {TokenizedPartError.__name__: TokenizedPartError}


def unwrap_worker_error(exc: BaseException) -> Exception | None:
    """Our input error inside a (possibly Ray-wrapped) exception chain, or None."""
    known: dict[str, type[Exception]] = {**WorkerInputError.registry, **_FOREIGN}
    names = "|".join(map(re.escape, known))
    pattern = re.compile(rf"\b({names}): (.+)") if names else None
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, tuple(known.values())):
            return cur if isinstance(cur, Exception) else None
        match = pattern.search(str(cur)) if pattern else None
        if match:
            return known[match.group(1)](match.group(2).strip())
        cur = cur.__cause__ or cur.__context__
    return None
