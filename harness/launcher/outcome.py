"""What each rank of a case did (``RankOutcome``, a file each rank writes), and the one
verdict and report made of it (``CaseOutcome``: the first failure first); rank output and
log records, bounded."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import pydoc
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from harness.jsonio import write_bytes

PASSED, FAILED, SKIPPED, XFAILED = "passed", "failed", "skipped", "xfailed"
#: A Hypothesis example the body rejected (``assume``): neither a pass nor a failure.
REJECTED = "rejected"

# A dead peer makes the survivors' collectives fail a moment later: a rank that died
# without reporting is ordered before failures this much later, as the likelier cause.
_DEATH_PRECEDENCE_S = 1.0
_OUTPUT_TAIL_LINES = 30
#: Of a rank's failure summary and traceback, the report keeps this many head and tail chars.
SUMMARY_KEEP_CHARS = 500
TRACEBACK_KEEP_CHARS = 32 * 1024


def bounded(text: str, keep: int) -> str:
    """``text``, or its first and last ``keep`` characters around a note of what was dropped."""
    if len(text) <= 2 * keep:
        return text
    dropped = len(text) - 2 * keep
    return f"{text[:keep]}[harness: {dropped} characters dropped]{text[-keep:]}"


@dataclass
class RankOutcome:
    """How one rank's function ended (``at``: wall-clock time; ``summary``: the exception or
    skip reason; ``value``: the pickled return value; ``exc_types``: a failure's class and
    bases as ``module.qualname``; ``feedback``: ``given.Feedback``; ``records``: log records
    as dicts; ``leaked``: ``pid N: command`` of processes it left running, stopped)."""

    rank: int
    status: str
    at: float
    summary: str = ""
    traceback: str = ""
    value: bytes | None = None
    exc_types: tuple[str, ...] = ()
    warnings: list[tuple[str, str, str, int]] = field(default_factory=list)
    feedback: Any = None
    records: list[dict[str, Any]] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.summary = bounded(self.summary, SUMMARY_KEEP_CHARS)
        self.traceback = bounded(self.traceback, TRACEBACK_KEEP_CHARS)

    def write(self, path: str) -> None:
        write_bytes(path, pickle.dumps(self))

    @staticmethod
    def read(path: str) -> RankOutcome | None:
        """The outcome at ``path`` (None: the rank wrote none)."""
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return None


#: Log records a rank reports per case (a loop logging a million times must not flood it).
MAX_RECORDS = 1000


class _Collector(logging.Handler):
    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__(logging.NOTSET)
        self.records = records
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) >= MAX_RECORDS:
            self.dropped += 1
            return
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        fields = dict(vars(record), msg=record.getMessage(), args=None, exc_info=None)
        plain = (str, int, float, type(None))
        self.records.append({k: v for k, v in fields.items() if isinstance(v, plain)})


@contextlib.contextmanager
def capture_logs(level: int | None) -> Iterator[list[dict[str, Any]]]:
    """In a rank: the first ``MAX_RECORDS`` log records emitted inside, as plain dicts, the
    root logger at ``level`` meanwhile (pytest's ``log_level``; None: left as it is)."""
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
            warning = {"name": "harness", "levelno": logging.WARNING, "levelname": "WARNING"}
            message = f"{handler.dropped} more log records of this rank dropped"
            records.append({**warning, "msg": message})


def _warning_class(name: str) -> type[Warning]:
    with contextlib.suppress(Exception):
        found = pydoc.locate(name)
        if isinstance(found, type) and issubclass(found, Warning):
            return found
    return UserWarning


def describe_exit(code: int) -> str:
    """``was killed by signal SIGKILL (9)`` / ``exited with code 3``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


@dataclass
class _Failure:
    at: float
    rank: int
    headline: str
    detail: str
    exc_types: tuple[str, ...] = ()


@dataclass
class CaseOutcome:
    """Everything observed about one launch of ``nproc`` ranks."""

    nproc: int
    label: str
    deadline_s: float
    deadline_source: str
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    #: rank -> (wall time, exit code) of ranks that exited by themselves
    exits: dict[int, tuple[float, int]] = field(default_factory=dict)
    timed_out: list[int] = field(default_factory=list)
    #: timed out before every rank was ready (``deadline_s``: the start bound)
    starting: bool = False
    start_s: float | None = None  # how long the ranks took to be ready
    #: ranks stopped for running on after another rank failed
    abandoned: list[int] = field(default_factory=list)
    abandon_grace_s: float = 0.0
    stacks: dict[int, str] = field(default_factory=dict)  # dumped just before a stop
    logs: dict[int, str] = field(default_factory=dict)  # captured output
    survivors: list[int] = field(default_factory=list)  # alive after SIGKILL
    cards: tuple[str, ...] = ()
    ranks: str = "fresh"  # or "kept (case N of its pool)"
    notes: list[str] = field(default_factory=list)  # what the harness did worth telling
    ranks_per_node: int = 0  # multi-node: reports name each rank's node (0: one node)
    #: node -> what went wrong with it besides its ranks (its agent never came, or ended early)
    node_problems: dict[int, str] = field(default_factory=dict)
    deadline_passed: bool = False

    def who(self, rank: int) -> str:
        """``rank 3``, or ``node 1 rank 3`` in a multi-node case."""
        if self.ranks_per_node:
            return f"node {rank // self.ranks_per_node} rank {rank}"
        return f"rank {rank}"

    def has_failure(self) -> bool:
        """A rank failed, or exited before reporting or with a non-zero code."""
        return any(o.status == FAILED for o in self.outcomes.values()) or any(
            rank not in self.outcomes or code != 0 for rank, (_, code) in self.exits.items()
        )

    def _failures(self) -> list[_Failure]:
        failures = []
        for rank in range(self.nproc):
            outcome, exit_ = self.outcomes.get(rank), self.exits.get(rank)
            if outcome is not None and outcome.status == FAILED:
                headline = f"{self.who(rank)} failed: {outcome.summary}"
                failures.append(
                    _Failure(outcome.at, rank, headline, outcome.traceback, outcome.exc_types)
                )
            elif exit_ is not None and (outcome is None or exit_[1] != 0):
                at, code = exit_
                if outcome is None:
                    at, what = at - _DEATH_PRECEDENCE_S, "before reporting an outcome"
                    what = f"{describe_exit(code)} {what}"
                else:
                    what = f"{outcome.status}, then {describe_exit(code)} while shutting down"
                failures.append(
                    _Failure(at, rank, f"{self.who(rank)} {what}", self._output_tail(rank))
                )
        return sorted(failures, key=lambda f: (f.at, f.rank))

    def _output_tail(self, rank: int) -> str:
        log = self.logs.get(rank, "")
        if not log.strip():
            return ""
        lines = log.rstrip("\n").splitlines()[-_OUTPUT_TAIL_LINES:]
        return f"--- rank {rank} output (last {len(lines)} lines) ---\n" + "\n".join(lines)

    @property
    def status(self) -> str:
        """failed if any rank failed, died or ran out of time; else the first of rejected
        (a Hypothesis example), xfailed, skipped that any rank had; else passed."""
        if self.timed_out or self.abandoned or self.node_problems or self._failures():
            return FAILED
        if len(self.outcomes) < self.nproc:
            return FAILED
        statuses = {o.status for o in self.outcomes.values()}
        return next((s for s in (REJECTED, XFAILED, SKIPPED) if s in statuses), PASSED)

    def failure_types(self) -> tuple[str, ...]:
        """``module.qualname`` of the report's leading exception and its bases (empty: a
        timeout, a dead rank)."""
        if self.timed_out:
            return ()
        failures = self._failures()
        return failures[0].exc_types if failures else ()

    def reissue_warnings(self) -> None:
        """Issue the ranks' warnings again here, once per distinct warning naming its ranks."""
        seen: dict[tuple[str, str, str, int], list[int]] = {}
        for rank in sorted(self.outcomes):
            for warning in self.outcomes[rank].warnings:
                seen.setdefault(tuple(warning), []).append(rank)
        for (category, message, filename, lineno), ranks in seen.items():
            which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            warnings.warn_explicit(
                f"[{which}] {bounded(message, SUMMARY_KEEP_CHARS)}",
                _warning_class(category),
                filename,
                lineno,
            )

    def feedbacks(self) -> dict[int, Any]:
        """Each rank's ``RankOutcome.feedback`` that it reported, by rank."""
        return {r: o.feedback for r, o in self.outcomes.items() if o.feedback is not None}

    def reissue_logs(self) -> None:
        """Hand the ranks' log records, prefixed ``[rank N]``, to their loggers here (so
        pytest's log capture shows them as the test's own)."""
        for rank in sorted(self.outcomes):
            for fields in self.outcomes[rank].records:
                message = f"[rank {rank}] {fields.get('msg', '')}"
                record = logging.makeLogRecord(dict(fields, msg=message))
                logging.getLogger(record.name).handle(record)

    def reason(self) -> str:
        """The skip / xfail reason of the first rank that gave one."""
        given = (self.outcomes[r] for r in sorted(self.outcomes))
        return next((o.summary for o in given if o.status in (SKIPPED, XFAILED)), "")

    def values(self) -> list[Any]:
        """Each rank's return value, in rank order (only for a passed case)."""
        blobs = (self.outcomes[r].value for r in range(self.nproc))
        return [None if blob is None else pickle.loads(blob) for blob in blobs]

    def report(self) -> str:
        """The failure report: ranks that ran out of time first, else the first failing rank
        with its traceback; then one line per other failing rank."""
        sections: list[str] = []
        failures = self._failures()
        shape = f"{self.nproc} rank{'s' if self.nproc != 1 else ''}, {self.label}"
        if self.node_problems:
            when = (
                f" at the {self.deadline_s:g} s deadline ({self.deadline_source})"
                if self.deadline_passed
                else ""
            )
            sections.append(
                f"case failed on its nodes{when} ({shape}):\n"
                + "\n".join(f"node {k}: {why}" for k, why in self.node_problems.items())
            )
        if self.timed_out:
            ranks = ", ".join(str(r) for r in self.timed_out)
            which = f"rank{'s' if len(self.timed_out) > 1 else ''} {ranks}"
            if self.ranks_per_node:
                which = ", ".join(self.who(r) for r in self.timed_out)
            if self.starting:
                headline = (
                    f"{which} not ready to run the test {self.deadline_s:g} s after they were "
                    f"started ({self.deadline_source}: spawning, imports, joining the process "
                    "group; the case deadline had not begun)"
                )
            else:
                headline = (
                    f"{which} still running at the {self.deadline_s:g} s deadline "
                    f"({self.deadline_source})"
                )
                if self.start_s is not None:
                    headline += (
                        ", counted from the moment the ranks were ready "
                        f"({self.start_s:.1f} s after they were started)"
                    )
            sections.append(
                f"case timed out ({shape}): {headline}; stopped with SIGTERM, then SIGKILL"
            )
            sections.extend(self._stack_section(r, "at the deadline") for r in self.timed_out)
        elif failures:
            first, failures = failures[0], failures[1:]
            sections.append(f"{first.headline}\n({shape})")
            if first.detail:
                sections.append(first.detail.rstrip("\n"))
        summary = [f.headline for f in failures]
        summary.extend(
            f"{self.who(r)} was still running {self.abandon_grace_s:g} s after the first failure; "
            "stopped (stack in the output below)"
            for r in self.abandoned
        )
        if summary:
            sections.append("other ranks:\n" + "\n".join(f"  {line}" for line in summary))
        sections.extend(self._stack_section(r, "when stopped") for r in self.abandoned)
        missing = [r for r in range(self.nproc) if r not in self.outcomes and r not in self.exits]
        if missing and not (self.timed_out or self.abandoned or self.node_problems):
            sections.append(f"ranks {missing} ended without an outcome")
        if self.survivors:
            sections.append(f"WARNING: pids {self.survivors} were still alive after SIGKILL")
        return "\n\n".join(sections)

    def _stack_section(self, rank: int, when: str) -> str:
        stack = self.stacks.get(rank, "").rstrip("\n")
        if not stack:
            stack = (
                "(no Python stack: the rank did not answer the stack-dump signal -- not yet "
                "running Python code, stuck in native code, or stopped by a signal or a debugger)"
            )
        return f"--- {self.who(rank)} stack {when} ---\n{stack}"


#: Of a rank's output per case, the first and the last this many bytes are kept.
OUTPUT_HEAD_BYTES = 64 * 1024
OUTPUT_TAIL_BYTES = 256 * 1024


def file_size(path: str) -> int:
    """The size of ``path`` in bytes (0 when it does not exist)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_bounded(path: str, what: str = "this rank's output") -> str:
    """The output at ``path`` (``what``): all of it when short, else its head, a line saying
    how many bytes were dropped, and its tail (only those read into memory)."""
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
        f"{head_text}\n[harness: {dropped} bytes of {what} dropped; "
        f"the first {len(head)} and the last {len(tail)} are kept]\n{tail_text}"
    )


def echo_logs(result: CaseOutcome) -> None:
    """Write the harness's notes on the case, then each rank's captured output."""
    sys.stdout.writelines(f"harness: {note}\n" for note in result.notes)
    for rank, text in sorted(result.logs.items()):
        if text.strip():
            end = "" if text.endswith("\n") else "\n"
            sys.stdout.write(f"----- rank {rank} output -----\n{text}{end}")
    sys.stdout.flush()
