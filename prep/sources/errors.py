"""The per-record failure of a reader: the record cannot become a conversation."""

from __future__ import annotations

from schemas.reasons import Reason


class RecordError(Exception):
    """One input record is unusable; ``reason`` becomes the error row's code."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
