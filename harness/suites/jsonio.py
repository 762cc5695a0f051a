"""The harness's one way to write a JSON (or other text) file: atomically.

A reader (a shard job merging durations, CI uploading an artifact, a pytest worker reading
its selection) sees the old file or the new one, never a half-written one: the text goes to
a temporary file in the same directory, which then replaces the target (``os.replace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["write_json", "write_text"]


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating its parent directories.

    The file gets the mode a plain ``open(path, "w")`` would give (``0o666`` less the
    umask), not ``mkstemp``'s owner-only one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, doc: Any, *, indent: int | None = 1) -> None:
    """Write ``doc`` as JSON (``indent``; ``None``: one line) plus a newline to ``path``,
    atomically (:func:`write_text`). A number that is not finite is a ``ValueError``,
    never a file other JSON readers refuse."""
    write_text(path, json.dumps(doc, indent=indent, allow_nan=False) + "\n")
