"""Suite manifests (docs/suites.md): load ``suites/*.json`` strictly, validate them against
the shipped schema and splice in includes; every problem names its file and JSON pointer."""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from pathspec.patterns.gitignore.basic import GitIgnoreBasicPattern

from harness import names
from harness.errors import HarnessError

SUITES_DIR = "suites"
SCHEMA_FILE = "schema.json"
DEFAULT_ESTIMATED_S = 5.0
# The rest of a job's timeout absorbs setup, estimate error and slow runners.
DEFAULT_BUDGET_FRACTION = 0.75


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the suites: ``rule`` (a stable name, ``harness.names``), the
    repository-relative ``file`` at fault, ``where`` in it (a JSON pointer or a node id)."""

    rule: str
    file: str
    where: str
    message: str
    suite: str | None = None

    def __str__(self) -> str:
        if self.where.startswith(self.file + "::"):
            return f"{self.where}: [{self.rule}] {self.message}"  # a node id names its file
        where = f" {self.where}" if self.where else ""
        return f"{self.file}{where}: [{self.rule}] {self.message}"


class ManifestError(HarnessError):
    """A manifest could not be loaded; ``problems`` says why and where."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class Runner:
    """A class of CI runner: its ``runs-on`` labels, cards, job timeout and shard budget,
    and the ``container`` (``image``, ``options``) its jobs run in (None: on the host)."""

    labels: tuple[str, ...]
    cards: int
    timeout_minutes: int
    budget_minutes: float
    name: str
    container: dict[str, str] | None = field(default=None, hash=False)
    nodes: int = 1  # what a job gives a multi-node case: emulated on one host, or torchrun's

    @property
    def budget_s(self) -> float:
        """Most planned case seconds one shard on this runner may hold."""
        return self.budget_minutes * 60.0


@dataclass(frozen=True)
class Flaky:
    """An entry's ``flaky``: a failed case is rerun up to ``retries`` times (``reason``: why)."""

    retries: int
    reason: str


@dataclass(frozen=True)
class Quarantine:
    """An entry's ``quarantine``: its cases' failures do not make a run red through ``until``
    (the last day it holds); ``reason``: why."""

    reason: str
    until: datetime.date


@dataclass(frozen=True)
class Entry:
    """One manifest entry (docs/suites.md says each field); ``source`` / ``pointer`` locate its
    definition; ``depends_on`` None: none declared (it always runs); ``device`` None: each
    case's own; with ``command``, ``paths`` is empty."""

    id: str
    paths: tuple[str, ...]
    markers: str | None
    timeout_s: float | None
    estimated_s: float
    depends_on: tuple[str, ...] | None
    source: str
    pointer: str
    device: str | None = None
    cards: int = 1
    env: dict[str, str] = field(default_factory=dict, hash=False)
    flaky: Flaky | None = None
    quarantine: Quarantine | None = None
    command: tuple[str, ...] | None = None
    expect_output: str | None = None

    @property
    def accelerator(self) -> str | None:
        """The accelerator the entry's plain cases run on (None: cpu, or none said)."""
        return self.device if self.device not in (None, "cpu") else None


@dataclass(frozen=True)
class Manifest:
    """A loaded suite: name, device, runner classes (ascending cards) and entries in order."""

    suite: str
    device: str
    runners: tuple[Runner, ...]
    entries: tuple[Entry, ...]
    path: str
    run_everything_on: tuple[str, ...] | None = None  # None: changes.RUN_EVERYTHING

    @property
    def max_cards(self) -> int:
        return max(r.cards for r in self.runners)

    @property
    def max_nodes(self) -> int:
        return max(r.nodes for r in self.runners)


def find_root(start: Path | None = None) -> Path:
    """The repository root: the nearest directory at or above ``start`` (default: the
    working directory) that has a ``suites/`` directory; ``start`` itself when none does."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / SUITES_DIR).is_dir()), here)


def rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in POSIX form (the path itself when outside); a link
    inside the repository keeps its own name."""
    for p, r in ((os.path.abspath(path), os.path.abspath(root)), (path.resolve(), root.resolve())):
        try:  # the second: ``root`` reached through a symlink (/tmp -> /private/tmp)
            return Path(p).relative_to(r).as_posix()
        except ValueError:
            pass
    return str(path)


def suite_files(root: Path) -> list[Path]:
    """``suites/*.json`` of the repository at ``root``, sorted."""
    return sorted((root / SUITES_DIR).glob("*.json"))


def suite_name(name_or_path: str) -> str:
    """The suite a command-line argument names: ``gpu``, or the stem of ``suites/gpu.json``."""
    return Path(name_or_path).stem if name_or_path.endswith(".json") else name_or_path


def resolve_suite(root: Path, name_or_path: str) -> Path:
    """The manifest file for a suite name (``gpu``) or path (``suites/gpu.json``); raises
    ``ManifestError`` (``unknown-suite``) naming the known suites when there is none."""
    candidates = [root / name_or_path] * (Path(name_or_path).suffix == ".json")  # root / abs = abs
    for found in [*candidates, root / SUITES_DIR / f"{name_or_path}.json"]:
        if found.is_file():
            return found
    known = ", ".join(f.stem for f in suite_files(root)) or "none"
    where = f"no such suite in {root / SUITES_DIR} (known: {known})"
    raise ManifestError([Problem(names.UNKNOWN_SUITE, f"{SUITES_DIR}/", name_or_path, where)])


def has_glob(pattern: str) -> bool:
    return bool(re.search(r"[*?\[]", pattern))


# Unbounded: a bounded cache smaller than the patterns in use thrashes (PITFALLS).
@functools.cache
def glob_regex(pattern: str) -> re.Pattern[str]:
    """A repository-relative glob compiled by git's wildmatch rules (pathspec); a ``match``
    may end at a ``/`` (a path under a directory the glob names). Unlike a ``.gitignore``
    line it is anchored at the root, and ``!`` / ``#`` are plain characters."""
    text = pattern.rstrip("/")
    if "/" not in text:
        text = "/" + text  # anchored at the root
    elif text.startswith(("!", "#")):
        text = "\\" + text  # not a negation, not a comment
    regex, _ = GitIgnoreBasicPattern.pattern_to_regex(text)
    return re.compile(regex, re.DOTALL)


def path_matches(path: str, pattern: str) -> bool:
    """True when repository-relative ``path`` is ``pattern``, lies under the directory
    ``pattern``, or matches the glob ``pattern`` (or lies under a directory matching it);
    ``DIR/**`` also matches ``DIR`` itself (git names a changed submodule by its folder)."""
    pattern = pattern.rstrip("/")
    if pattern in ("", "."):
        return True
    if pattern.endswith("/**") and path_matches(path, pattern[:-3]):
        return True
    if has_glob(pattern):
        rx = glob_regex(pattern)
        parts = path.split("/")
        return any(rx.match("/".join(parts[:k])) for k in range(1, len(parts) + 1))
    return path == pattern or path.startswith(pattern + "/")


def _outside(root: Path, path: str) -> str | None:
    """Why repository-relative ``path`` escapes ``root`` (None: it stays inside)."""
    if path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path):
        return "is absolute; paths are relative to the repository root"
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../"):
        return "is outside the repository"
    target = root / norm
    if (
        not has_glob(path)
        and target.exists()
        and not target.resolve().is_relative_to(root.resolve())
    ):
        return "leads outside the repository (through a symlink)"
    return None


class _NotJson(ValueError):
    """What Python's JSON reader takes and JSON does not: a duplicate key (the last would win
    silently), ``NaN`` / ``Infinity`` / ``1e999`` (they break ``harness matrix``'s JSON)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _NotJson(f"duplicate key {k!r} in an object")
        out[k] = v
    return out


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise _NotJson(f"{text} is not a finite number")
    return value


def _int(text: str) -> int:
    # One no float holds passes the schema, then breaks comparisons with float deadlines.
    if len(text.lstrip("-")) > 308 or not math.isfinite(float(value := int(text))):
        raise _NotJson(f"{text[:12]}... ({len(text)} digits) is not a finite number")
    return value


def read_json(path: Path, root: Path) -> Any:
    """Parse a JSON file strictly (no duplicate keys, only finite numbers); raises
    ``ManifestError`` (rule ``json``) naming the file (and a syntax error's line and column)."""
    name = rel(path, root)

    def refused(message: str, file: str = name) -> ManifestError:
        return ManifestError([Problem(names.JSON, file, "", message)])

    strict = {"parse_float": _finite, "parse_int": _int, "parse_constant": _finite}
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_object, **strict)
    except OSError as e:
        raise refused(f"cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise refused(f"not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise refused(f"not valid JSON: {e.msg}", f"{name}:{e.lineno}:{e.colno}") from e
    except _NotJson as e:
        raise refused(f"not valid JSON: {e}") from e
    except RecursionError:
        raise refused("nested too deeply (past Python's recursion limit)") from None


def pointer(parts: Iterable[Any]) -> str:
    """RFC 6901 JSON pointer for a path of keys and indices (``<root>`` for the document)."""
    out = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return out or "<root>"


@functools.cache
def load_schema() -> dict[str, Any]:
    """The manifest JSON Schema shipped in this package (``harness/suites/schema.json``)."""
    return json.loads((Path(__file__).resolve().parent / SCHEMA_FILE).read_text(encoding="utf-8"))


@functools.cache
def _validator(definition: str) -> jsonschema.Draft202012Validator:
    # One definition as the root: errors point into it, not at the root's if/then/else.
    defs = load_schema()["$defs"]
    schema = {"$defs": defs, "$ref": f"#/$defs/{definition}"}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER  # quarantine's "until": a date
    return jsonschema.Draft202012Validator(schema, format_checker=checker)


def validate(doc: Any, root: Path, name: str, definition: str = "manifest") -> list[Problem]:
    """Schema problems of ``doc`` (from file ``name``), each with the JSON pointer of the
    bad value, in document order."""
    errors = sorted(_validator(definition).iter_errors(doc), key=lambda e: [*map(str, e.path)])
    return [Problem(names.SCHEMA, name, pointer(e.absolute_path), e.message) for e in errors]


@functools.cache  # unbounded, like glob_regex
def marker_expression(expr: str) -> Any:
    """pytest's own compiled ``-m`` expression for ``expr`` (raises its ``ParseError``)."""
    from _pytest.mark.expression import Expression

    return Expression.compile(expr)


def read_runners(doc: dict[str, Any]) -> tuple[Runner, ...]:
    """The runner classes of a valid manifest document, by ascending cards."""
    raw = doc["runner"] if isinstance(doc["runner"], list) else [doc["runner"]]
    runners = (
        Runner(
            labels=tuple(r["labels"]),
            cards=int(r["cards"]),
            timeout_minutes=int(r["timeout_minutes"]),
            budget_minutes=float(
                r.get("budget_minutes", r["timeout_minutes"] * DEFAULT_BUDGET_FRACTION)
            ),
            name=r.get("name") or "-".join(r["labels"]),
            container=r.get("container"),
            nodes=int(r.get("nodes", 1)),
        )
        for r in raw
    )
    return tuple(sorted(runners, key=lambda r: r.cards))


def _case_entry(
    raw: dict[str, Any], name: str, ptr: str, root: Path, problems: list[Problem]
) -> Entry:
    """A schema-valid entry; what the schema cannot say goes into ``problems``."""

    def bad(key: str, why: str, rule: str = names.SCHEMA) -> None:
        problems.append(Problem(rule, name, f"{ptr}/{key}", why))

    if "command" in raw:
        for key in ("paths", "markers"):
            if key in raw:
                bad(
                    key,
                    "an entry has either paths or a command, not both: a command entry is one "
                    f"case, its command, and selects no test ({key!r} given)",
                )
        try:
            re.compile(raw.get("expect_output", ""), re.MULTILINE)
        except re.error as e:
            bad(
                "expect_output",
                f"expect_output {raw['expect_output']!r} is not a regular expression: {e}",
            )
    elif "expect_output" in raw:
        bad(
            "expect_output",
            "expect_output applies to a command entry; this entry has paths, no command",
        )
    deps = raw.get("depends_on")
    for key, values in (("paths", raw.get("paths", ())), ("depends_on", deps or ())):
        for j, path in enumerate(values):
            if why := _outside(root, path.split("::", 1)[0]):
                bad(f"{key}/{j}", f"{path!r} {why}", names.PATH)
    if "markers" in raw:
        try:
            marker_expression(raw["markers"])
        except Exception as e:  # pytest's ParseError: keep the message, whatever the class
            bad("markers", f"bad -m expression {raw['markers']!r}: {e}")
    if "cards" in raw and raw.get("device") == "cpu":
        bad(
            "cards",
            "`cards` on a cpu entry: only an accelerator entry (device cuda or npu) leases cards",
        )
    elif "cards" in raw and raw.get("device") is None:
        bad("cards", "`cards` needs the entry's `device` (cuda or npu): its plain cases lease them")
    flaky, q = raw.get("flaky"), raw.get("quarantine")
    return Entry(
        id=raw["id"],
        paths=tuple(p.rstrip("/") or "." for p in raw.get("paths", ())),
        markers=raw.get("markers"),
        timeout_s=raw.get("timeout_s"),
        estimated_s=float(raw.get("estimated_s", DEFAULT_ESTIMATED_S)),
        depends_on=tuple(deps) if deps is not None else None,
        source=name,
        pointer=ptr,
        device=raw.get("device"),
        cards=int(raw.get("cards", 1)),
        env=dict(raw.get("env", {})),
        flaky=Flaky(flaky["retries"], flaky["reason"]) if flaky else None,
        quarantine=Quarantine(q["reason"], datetime.date.fromisoformat(q["until"])) if q else None,
        command=tuple(raw["command"]) if "command" in raw else None,
        expect_output=raw.get("expect_output"),
    )


def _expand(
    entries: list[Any],
    name: str,
    root: Path,
    chain: tuple[str, ...],
    problems: list[Problem],
) -> list[Entry]:
    """The entries of file ``name``, includes spliced in (``chain``: the files including it)."""
    out: list[Entry] = []
    for i, raw in enumerate(entries):
        ptr = f"/entries/{i}"
        if "include" not in raw:
            out.append(_case_entry(raw, name, ptr, root, problems))
            continue
        target_rel, at = raw["include"], f"{ptr}/include"
        target = root / posixpath.normpath(target_rel)
        tname = rel(target, root)
        if why := _outside(root, target_rel):
            problems.append(Problem(names.PATH, name, at, f"{target_rel!r} {why}"))
        elif tname in chain:
            cycle = " -> ".join((*chain, tname))
            problems.append(Problem(names.INCLUDE, name, at, f"include cycle: {cycle}"))
        elif not target.is_file():
            problems.append(Problem(names.INCLUDE, name, at, f"{target_rel!r} does not exist"))
        else:
            try:
                doc = read_json(target, root)
            except ManifestError as e:
                problems.extend(e.problems)
                continue
            kind = "manifest" if isinstance(doc, dict) and "suite" in doc else "caseList"
            found = validate(doc, root, tname, kind)
            problems.extend(found)
            if not found:
                out += _expand(doc["entries"], tname, root, (*chain, tname), problems)
    return out


def load_manifest(path: Path, root: Path) -> Manifest:
    """Load, validate and expand one suite manifest; raises ``ManifestError`` listing every
    problem found (duplicate entry ids aside: :func:`duplicate_entries`)."""
    name = rel(path, root)
    doc = read_json(path, root)
    problems = validate(doc, root, name, "manifest")
    if problems:
        raise ManifestError(problems)

    def bad(where: str, why: str, rule: str = names.SCHEMA, file: str = name) -> None:
        problems.append(Problem(rule, file, where, why))

    if doc["suite"] != path.stem:
        bad("/suite", f"suite {doc['suite']!r} must match the file name {path.stem!r}")
    runners = read_runners(doc)
    if len({json.dumps(r.container, sort_keys=True) for r in runners}) > 1:
        bad(
            "/runner",
            "every runner class of a suite runs its shard jobs in the same container "
            "(or none): give each the same `container`",
        )
    entries = _expand(doc["entries"], name, root, (name,), problems)
    for e in entries:
        if e.device is not None and e.device != doc["device"]:
            bad(
                f"{e.pointer}/device",
                f"entry {e.id!r} says device {e.device!r}, but suite "
                f"{doc['suite']!r} runs on {doc['device']}: give it the suite's device or leave "
                "`device` out",
                file=e.source,
            )
    globs = doc.get("run_everything_on")
    for j, g in enumerate(globs or ()):
        if why := _outside(root, g):
            bad(f"/run_everything_on/{j}", f"{g!r} {why}", names.PATH)
    if problems:
        raise ManifestError(problems)
    return Manifest(
        suite=doc["suite"],
        device=doc["device"],
        runners=runners,
        entries=tuple(entries),
        path=name,
        run_everything_on=tuple(globs) if globs is not None else None,
    )


def duplicate_entries(manifest: Manifest) -> list[Problem]:
    """One ``duplicate-entry-id`` problem per entry whose id an earlier entry of the suite uses."""
    first: dict[str, Entry] = {}
    out = []
    for e in manifest.entries:
        f = first.setdefault(e.id, e)
        if f is not e:
            why = f"entry id {e.id!r} of suite {manifest.suite!r} is already used at {f.source} {f.pointer}"
            out.append(
                Problem(names.DUPLICATE_ENTRY_ID, e.source, e.pointer + "/id", why, manifest.suite)
            )
    return out


def load_suites(
    root: Path, names: Iterable[str] | None = None
) -> tuple[list[Manifest], list[Problem]]:
    """Load the named suites (default: every ``suites/*.json``) of the repository at ``root``:
    the manifests that loaded, and every problem (of those that did not, duplicate ids,
    expired quarantines; an unknown name: ``unknown-suite``)."""
    problems: list[Problem] = []
    files: list[Path] = [] if names else suite_files(root)
    for n in names or ():
        try:
            files.append(resolve_suite(root, n))
        except ManifestError as e:
            problems.extend(e.problems)
    manifests = []
    for f in dict.fromkeys(files):
        try:
            m = load_manifest(f, root)
        except ManifestError as e:
            problems.extend(Problem(p.rule, p.file, p.where, p.message, f.stem) for p in e.problems)
            continue
        manifests.append(m)
        problems.extend(duplicate_entries(m))
        problems.extend(expired_quarantines(m))
    return manifests, problems


def expired_quarantines(manifest: Manifest, today: datetime.date | None = None) -> list[Problem]:
    """One ``quarantine-expired`` problem per entry whose ``quarantine`` ended before ``today``
    (default: the local date now)."""
    return [
        Problem(
            names.QUARANTINE_EXPIRED,
            e.source,
            e.pointer + "/quarantine/until",
            f"the quarantine of entry {e.id!r} ({e.quarantine.reason}) ended on "
            f"{e.quarantine.until.isoformat()}: fix its cases and lift it, or extend `until`",
            manifest.suite,
        )
        for e in manifest.entries
        if e.quarantine is not None and (today or datetime.date.today()) > e.quarantine.until
    ]
