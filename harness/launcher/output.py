"""Rank output, bounded: each rank's captured output of a case is kept to its
head and tail on disk while it runs (the middle punched out of the file) and
read back the same way, so a chatty rank costs neither disk nor memory."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.launcher.outcome import CaseOutcome

#: Per rank and case, the first and the last this many bytes of its output
#: are kept (on disk while it runs); what lies between is dropped and counted.
OUTPUT_HEAD_BYTES = 64 * 1024
OUTPUT_TAIL_BYTES = 256 * 1024

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_BLOCK = 4096


def file_size(path: str) -> int:
    """The size of ``path`` in bytes (0 when it does not exist)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def bound_output(path: str) -> None:
    """Keep a rank's output file to its first ``OUTPUT_HEAD_BYTES`` and last
    ``OUTPUT_TAIL_BYTES`` on disk: the middle is punched out (the file keeps
    its size, the dropped bytes read as NULs and take no space). A file
    system that cannot punch holes keeps it all; reading stays bounded."""
    size = file_size(path)
    if size <= OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES + _BLOCK:
        return
    start = -(-OUTPUT_HEAD_BYTES // _BLOCK) * _BLOCK
    end = (size - OUTPUT_TAIL_BYTES) // _BLOCK * _BLOCK
    if end <= start or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _libc().fallocate(
                fd,
                _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                ctypes.c_long(start),
                ctypes.c_long(end - start),
            )
        finally:
            os.close(fd)


_libc_handle: list[Any] = []


def _libc() -> Any:
    if not _libc_handle:
        _libc_handle.append(ctypes.CDLL(None, use_errno=True))
    return _libc_handle[0]


def read_bounded(path: str) -> str:
    """A rank's output: all of it when short, else its head, a line saying how
    many bytes were dropped, and its tail (never more than head + tail bytes
    read into memory)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES:
            return f.read().decode(errors="replace")
        head = f.read(OUTPUT_HEAD_BYTES)
        f.seek(size - OUTPUT_TAIL_BYTES)
        tail = f.read(OUTPUT_TAIL_BYTES)
    dropped = size - len(head) - len(tail)
    head_text = head.decode(errors="replace").rstrip("\x00")
    tail_text = tail.decode(errors="replace").lstrip("\x00")
    return (
        f"{head_text}\n[harness: {dropped} bytes of this rank's output dropped; "
        f"the first {len(head)} and the last {len(tail)} are kept]\n{tail_text}"
    )


def echo_logs(result: CaseOutcome, stream: Any = None) -> None:
    """Write the harness's notes on the case, then the ranks' captured output,
    one headed block per rank."""
    stream = stream or sys.stdout
    for note in result.notes:
        stream.write(f"harness: {note}\n")
    for rank in sorted(result.logs):
        text = result.logs[rank]
        if text.strip():
            stream.write(f"----- rank {rank} output -----\n{text}")
            if not text.endswith("\n"):
                stream.write("\n")
    stream.flush()
