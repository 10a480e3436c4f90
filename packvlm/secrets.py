"""Credentials stay out of every output: manifests, logs, error rows, reports, ``_run.json``.

Cloud sources take their credentials from the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, an endpoint URL that may carry
``user:password@``) or the SDK's own files, never from packvlm options. Three rules keep them
out of what packvlm writes:

- A URL in a dataset config that carries credentials (``s3://KEY:SECRET@bucket/...``) is
  refused (`schemas.dataset_config`): such a URL would be copied into manifests, error rows and
  pack metadata as the data's address.
- Every line the commands print or log and every error row's message passes through `redact`,
  which replaces the values of `SECRET_ENV` and any URL's ``user:password@`` with
  `REDACTED`; `install_log_redaction` puts it on the log handlers.
- The SDK loggers that dump requests at DEBUG (headers with the session token and the access
  key id) stay at INFO under ``-v``: `-v` is for packvlm's own debug lines.

Example::

    os.environ["AWS_SECRET_ACCESS_KEY"] = "s3cr3t-value"
    redact("failed with s3cr3t-value at http://u:p@host/x")  # 'failed with *** at http://***@host/x'
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from types import TracebackType

#: environment variables whose values are credentials (cloud SDKs, hub tokens)
SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",  # its user:password@ part; the whole value is not secret but is replaced only there
    "AWS_ENDPOINT_URL_S3",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
)
REDACTED = "***"
MIN_SECRET_CHARS = 6  # shorter values ("1", "us") would redact ordinary words
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]+)@")
#: SDK loggers that print request headers (credentials) at DEBUG
QUIET_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3fs", "fsspec", "urllib3", "gcsfs", "google.auth")


def secret_values() -> list[str]:
    """Credential values in the environment now, longest first (so a value containing another goes whole)."""
    values: set[str] = set()
    for name in SECRET_ENV:
        value = os.environ.get(name, "")
        if name.startswith("AWS_ENDPOINT_URL"):
            found = _USERINFO.search(value)
            values.update(found["userinfo"].split(":") if found else [])
        elif value:
            values.add(value)
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every credential of the environment and every URL's ``user:password@`` replaced."""
    for value in secret_values():
        text = text.replace(value, REDACTED)
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


class RedactingFilter(logging.Filter):
    """Redacts a record's formatted message (and drops its args) before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def _redacting_excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def install_log_redaction() -> None:
    """`RedactingFilter` on every root handler, the SDK loggers kept at INFO or above, and
    tracebacks (``--debug``) redacted."""
    sys.excepthook = _redacting_excepthook
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)
