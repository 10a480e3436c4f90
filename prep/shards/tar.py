"""Deterministic plain tar files: fixed metadata, written via temp name + rename.

`tarfile.TarFile.addfile` copies through 16 KiB buffers and builds headers slowly;
writing our fixed-metadata header, the payload and its padding with one ``writev`` keeps a
shard's write at disk speed. `iter_pack_metas` reads the json members back for the
conservation check.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from packvlm.atomic import atomic_path
from schemas.packed import META_MEMBER, TAR_MODE, TAR_MTIME

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
Member = tuple[str, bytes | memoryview]


def ustar_header(name: str, size: int) -> bytes:
    """512-byte USTAR header of a regular file with our fixed metadata.

    Byte-for-byte what ``TarInfo.tobuf(USTAR_FORMAT)`` gives for mode 0o644, mtime 0,
    uid/gid 0 and empty user/group names (a test checks it), at a fraction of the cost.
    """
    raw = name.encode("utf-8")
    if len(raw) > 100:
        raise ValueError(f"tar member name {name!r} longer than 100 bytes")
    if size >= 8**11:
        raise ValueError(f"tar member {name!r} of {size} bytes exceeds the USTAR limit")
    head = (
        raw.ljust(100, b"\0")
        + b"%07o\0" % TAR_MODE
        + b"0000000\0" * 2  # uid, gid
        + b"%011o\0" % size
        + b"%011o\0" % TAR_MTIME
    )
    tail = tarfile.REGTYPE + b"\0" * 100 + b"ustar\x0000" + b"\0" * (64 + 16 + 155)
    checksum = sum(head) + 8 * 32 + sum(tail)
    return (head + b"%06o\0 " % checksum + tail).ljust(BLOCK, b"\0")


class TarWriter:
    """Appends regular-file members with fixed metadata to an unbuffered binary file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.bytes_written = 0

    def _write(self, parts: list[bytes | memoryview]) -> None:
        total = sum(len(p) for p in parts)
        done = os.writev(self._fd, parts)
        if done < total:  # short write (signals, huge buffers): finish the rest plainly
            rest = b"".join(bytes(p) for p in parts)[done:]
            while rest:
                rest = rest[os.write(self._fd, rest) :]
        self.bytes_written += total

    def add(self, name: str, data: bytes | memoryview) -> None:
        """Header, payload and padding in one system call, no copy of the payload."""
        pad = -len(data) % BLOCK
        self._write([ustar_header(name, len(data)), data, b"\0" * pad])

    def close(self) -> None:
        """Two zero blocks end the archive; pad to a whole record like tarfile does."""
        end = 2 * BLOCK
        end += -(self.bytes_written + end) % RECORD
        self._write([b"\0" * end])


def write_tar_atomic(path: Path, samples: Iterable[list[Member]]) -> int:
    """Write samples (each a list of members, written in name order) to ``path``; returns bytes.

    The tar appears under its final name only when complete and synced, so a killed run (or
    a crashed machine) leaves at most a temp file, which a rerun removes and rewrites.
    """
    with atomic_path(path) as tmp, open(tmp, "wb", buffering=0) as fh:
        writer = TarWriter(fh.fileno())
        for members in samples:
            for name, data in sorted(members, key=lambda m: m[0]):
                writer.add(name, data)
        writer.close()
        os.fsync(fh.fileno())  # data on disk before the name: a crash never leaves a short shard
    return writer.bytes_written


def iter_pack_metas(path: Path) -> Iterator[tuple[str, dict]]:
    """(key, parsed json member) of every pack in a shard, reading headers only.

    A minimal USTAR reader (magic and checksum checked, payloads other than ``json``
    skipped by seeking) so the conservation check costs little next to the write; tests
    read shards with the stdlib `tarfile` instead.

    Raises:
        ValueError: The file is not a well-formed tar of regular files.
    """
    suffix = f".{META_MEMBER}"
    with open(path, "rb") as fh:
        while True:
            header = fh.read(BLOCK)
            if len(header) < BLOCK:
                raise ValueError(f"{path}: truncated tar (no end-of-archive blocks)")
            if header == b"\0" * BLOCK:
                return
            checksum = int(header[148:154] or b"0", 8)
            if header[257:263] != b"ustar\0" or checksum != sum(header[:148]) + 256 + sum(header[156:]):
                raise ValueError(f"{path}: bad tar header at byte {fh.tell() - BLOCK}")
            name = header[:100].rstrip(b"\0").decode("utf-8")
            size = int(header[124:135], 8)
            if header[156:157] not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise ValueError(f"{path}: member {name!r} is not a regular file")
            if name.endswith(suffix) and name.count(".") == 1:
                payload = fh.read(size)
                if len(payload) < size:
                    raise ValueError(f"{path}: member {name!r} truncated")
                fh.seek(-size % BLOCK, os.SEEK_CUR)
                yield name[: -len(suffix)], json.loads(payload)
            else:
                fh.seek(size + -size % BLOCK, os.SEEK_CUR)
