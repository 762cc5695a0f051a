"""Log records a rank emits, reported as pytest reports them in-process ("Captured log
call"): the rank catches them (``capture``, at the launcher's ``log_level``) and the
launcher hands each to its own logging (``reissue``), prefixed with the rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

#: Records a rank reports per case (the first ones; a loop logging a million
#: times must not flood the report).
MAX_RECORDS = 1000


def level_of(config: Any) -> int | None:
    """The launcher's ``log_level`` (ini or ``--log-level``; None: not set)."""
    try:
        from _pytest.logging import get_log_level_for_setting

        return get_log_level_for_setting(config, "log_level")
    except Exception:
        return None


class _Collector(logging.Handler):
    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__(logging.NOTSET)
        self.records = records
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) >= MAX_RECORDS:
            self.dropped += 1
            return
        # Plain values only: the message formatted, the exception as text.
        fields = dict(vars(record))
        fields["msg"], fields["args"] = record.getMessage(), None
        if record.exc_info:
            fields["exc_text"] = record.exc_text or logging.Formatter().formatException(
                record.exc_info
            )
        fields["exc_info"] = None
        fields = {k: v for k, v in fields.items() if isinstance(v, (str, int, float, type(None)))}
        self.records.append(fields)


@contextlib.contextmanager
def capture(level: int | None) -> Iterator[list[dict[str, Any]]]:
    """In a rank: catch the records emitted inside as plain dicts, the root logger at
    ``level`` meanwhile (None: left as it is)."""
    records: list[dict[str, Any]] = []
    handler = _Collector(records)
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    if level is not None:
        root.setLevel(level)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        if handler.dropped:
            message = f"{handler.dropped} more log records of this rank dropped"
            records.append({"name": "harness", "levelno": logging.WARNING, "msg": message})
            records[-1]["levelname"] = "WARNING"


def reissue(rank: int, records: list[dict[str, Any]]) -> None:
    """In the launcher: hand a rank's records to the loggers they were emitted on."""
    for fields in records:
        record = logging.makeLogRecord(dict(fields, msg=f"[rank {rank}] {fields.get('msg', '')}"))
        logging.getLogger(record.name).handle(record)
