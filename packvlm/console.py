"""What the commands print while they run: our INFO lines, others' warnings, bars that stay whole.

`configure_logging` is called once by each CLI group (`prep`, `train`):

- packvlm's own loggers (``prep``, ``train``, ``packvlm``, ``schemas``) log INFO (DEBUG with
  ``-v``); every other library logs WARNING and above only (matplotlib's font cache, Energon's
  "Regenerating dataset UUID" and the like are noise to a user);
- lines go through ``tqdm.write``, which lifts an active progress bar, prints the line and redraws
  the bar, so a step's log line never lands in the middle of the bar (`TqdmLogHandler`).

Like ``logging.basicConfig``, it does nothing when the root logger already has handlers (a host
program's, or pytest's capture), so embedding packvlm keeps the host's logging.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

#: top-level packages whose INFO lines are part of the commands' output
OWN_PACKAGES = ("prep", "train", "families", "packvlm", "schemas", "benchmarks")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class TqdmLogHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """A stderr handler that prints through ``tqdm.write``, so progress bars and log lines never interleave."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def configure_logging(verbose: bool = False) -> None:
    """Console logging for a command: ours at INFO (DEBUG when ``verbose``), the rest at WARNING."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = TqdmLogHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OWN_PACKAGES:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)
