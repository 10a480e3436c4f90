"""A worker's image headers, read again only when the file may have changed (git's racy-clean rule).

Datasets name one image in several rows (questions on one picture, one page in several tasks),
and `prep.sources.media.image_header` opens the file, parses its header and checks its end
marker each time (~15 µs a JPEG). `HeaderMemo` keeps a file's header with its stamp (device,
inode, size, mtime and ctime in ns, the pixel limit) and answers from it while a fresh ``stat``
(~2 µs) gives the same stamp. A file it has no header for is opened at once and stamped with
``fstat`` of the open file before anything is read from it (`prep.sources.media.read_image_file`,
sized by the same ``fstat``): one open and one ``fstat`` for a new file, no ``stat`` of its path.
Any write, rename over, ``touch -d`` or ``chmod`` sets the ctime to the current time,
which the kernel does not let a user set back; so a header is kept only when the file's mtime and
ctime are at least `SETTLED_NS` old at the ``fstat`` before the read, and a change after that
``fstat`` gives a new ctime, hence a new stamp (a file renamed over the path is another inode). A
file changed within the last `SETTLED_NS`, LMDB values, table cells, and every error (missing,
corrupt, too large) take the full read every time, so messages and reasons are unchanged.

Example: ``photo.jpg`` (mtime an hour ago) in rows 3 and 40 of a worker's chunk: row 3 reads the
header and keeps it; row 40 ``stat``s the file, finds the same stamp, and reuses 640x480.
"""

from __future__ import annotations

import os
import time

from packvlm.image_header import DECODE_LIMIT_PIXELS
from prep.sources.media import ImageHeader, LmdbPool, image_header, open_image_fd, read_image_file
from schemas.media_ref import MediaRef

#: a file changed this recently (ns) is read again next time: timestamps are coarse (a tick)
SETTLED_NS = 2_000_000_000
#: headers kept per worker (oldest out first)
MAX_HEADERS = 16384
_clock_ns = time.time_ns  # the wall clock file times are stamped with (a test moves it on)

Stamp = tuple[int, int, int, int, int, int]


class HeaderMemo:
    """`image_header` with the headers of unchanged files kept (module docstring)."""

    def __init__(self, max_headers: int = MAX_HEADERS) -> None:
        self.max_headers = max_headers
        self._headers: dict[str, tuple[Stamp, ImageHeader]] = {}

    def clear(self) -> None:
        """Forget every header."""
        self._headers.clear()

    def image_header(self, ref: MediaRef, pool: LmdbPool, max_pixels: int = DECODE_LIMIT_PIXELS) -> ImageHeader:
        """What `prep.sources.media.image_header` returns (or raises) for ``ref``."""
        if ref.key is not None or ref.row is not None:
            return image_header(ref, pool, max_pixels)
        kept = self._headers.get(ref.path)
        if kept is not None:  # a stat (no open) tells whether it still holds
            try:
                st = os.stat(ref.path)
            except (OSError, ValueError):
                pass  # opening it says why
            else:
                if kept[0] == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, max_pixels):
                    return kept[1]
        fd = open_image_fd(ref.path)  # raises what image_header raises
        try:
            st = os.fstat(fd)  # the stamp of the very file read below, before the read
            header = read_image_file(fd, ref.path, max_pixels, st)
        finally:
            os.close(fd)
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, max_pixels)
        if _clock_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= SETTLED_NS and self.max_headers > 0:
            if kept is None and len(self._headers) >= self.max_headers:
                del self._headers[next(iter(self._headers))]
            self._headers[ref.path] = (stamp, header)
        return header
