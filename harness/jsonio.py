"""The one way the harness and the repository's scripts write a file: atomically (a
temporary file in the same directory replaces the target), so a reader never sees a
half-written one. Standard library only: the scripts run from a checkout."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, creating its parent directories, with the mode
    ``open(path, "wb")`` would give. On any error the target is left as it was and no
    temporary file stays behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`write_bytes`)."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int | None = 1) -> None:
    """Write ``doc`` as JSON (``indent``; ``None``: one line) plus a newline to ``path``,
    atomically; a number that is not finite is a ``ValueError``."""
    write_text(path, json.dumps(doc, indent=indent, allow_nan=False) + "\n")
