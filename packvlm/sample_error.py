"""The per-sample failure every tokenize step raises; the chunk loop turns it into an error row."""

from __future__ import annotations

from schemas.reasons import Reason


class SampleError(Exception):
    """One record cannot become a sample; carries a reason code for the errors table."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
