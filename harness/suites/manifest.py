"""Suite manifests: load ``suites/*.json``, validate them and expand shared case lists.

A manifest says which test cases run on which hardware::

    {
      "$schema": "../harness/suites/schema.json",
      "suite": "gpu",
      "device": "cuda",
      "runner": {"labels": ["self-hosted", "gpu"], "cards": 2, "timeout_minutes": 60},
      "entries": [
        {"include": "suites/cases/accelerator.json"},
        {"id": "ops", "paths": ["tests/channel_loss/test_ops.py"], "timeout_s": 120}
      ]
    }

Every path is relative to the repository root; paths that leave it are
rejected. ``{"include": FILE}`` splices in the entries of a shared case list
(``{"entries": [...]}``) or of another manifest, which is how the CUDA and NPU
suites run one case list without copying it. Problems are reported as
:class:`Problem` values naming the file and the JSON pointer of the bad value
(``suites/cpu.json /entries/0/timeout_s``), or the line and column of a JSON
syntax error.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from pathspec.patterns.gitignore.basic import GitIgnoreBasicPattern

from harness import names
from harness.errors import HarnessError
from harness.validation import is_finite, is_real

SUITES_DIR = "suites"
SCHEMA_FILE = "schema.json"
DEFAULT_ESTIMATED_S = 5.0
# Share of the job timeout a shard may be planned to fill: the rest absorbs
# setup, estimate error and slow runners.
DEFAULT_BUDGET_FRACTION = 0.75


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the suites, named precisely enough to fix it.

    ``rule`` is a short stable name (``schema``, ``unowned-file``, ...);
    ``file`` the repository-relative file at fault; ``where`` a JSON pointer
    into it or a test case's node id; ``message`` says what is wrong.
    """

    rule: str
    file: str
    where: str
    message: str
    suite: str | None = None

    def __str__(self) -> str:
        if self.where.startswith(self.file + "::"):
            return f"{self.where}: [{self.rule}] {self.message}"  # a case's node id names its file
        where = f" {self.where}" if self.where else ""
        return f"{self.file}{where}: [{self.rule}] {self.message}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


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

    @property
    def budget_s(self) -> float:
        """Most planned case seconds one shard on this runner may hold."""
        return self.budget_minutes * 60.0


@dataclass(frozen=True)
class Entry:
    """One manifest entry: a selection of cases plus how to run and plan them.

    ``source`` / ``pointer`` locate the entry's definition (which may be a
    shared case list included by the suite). ``depends_on`` is ``None`` when
    the entry has no declared dependencies (it then always runs).
    """

    id: str
    paths: tuple[str, ...]
    markers: str | None
    timeout_s: float | None
    estimated_s: float
    depends_on: tuple[str, ...] | None
    source: str
    pointer: str


@dataclass(frozen=True)
class Manifest:
    """A loaded suite: name, device, runner classes (ascending cards) and entries in order."""

    suite: str
    device: str
    runners: tuple[Runner, ...]
    entries: tuple[Entry, ...]
    path: str
    includes: tuple[str, ...] = field(default=())

    @property
    def max_cards(self) -> int:
        """Cards on the largest runner class of the suite."""
        return max(r.cards for r in self.runners)

    def entry(self, entry_id: str) -> Entry:
        """The first entry with this id; ``KeyError`` if none."""
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise KeyError(entry_id)


# --------------------------------------------------------------------------- paths


def find_root(start: Path | None = None) -> Path:
    """The repository root: the nearest directory at or above ``start`` (default:
    the working directory) that has a ``suites/`` directory; ``start`` itself when none does."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / SUITES_DIR).is_dir():
            return d
    return here


def rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in POSIX form (the path itself when outside).

    Symlinks are not followed: a link inside the repository keeps its own name
    (where its target lives is a separate question, see ``symlink-outside-repository``).
    """
    try:
        return Path(os.path.abspath(path)).relative_to(os.path.abspath(root)).as_posix()
    except ValueError:
        pass
    try:  # ``root`` reached through a symlink (/tmp -> /private/tmp)
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def suite_files(root: Path) -> list[Path]:
    """The suite manifests of a repository: ``suites/*.json``, sorted."""
    return sorted((root / SUITES_DIR).glob("*.json"))


def suite_name(name_or_path: str) -> str:
    """The suite a command-line argument names: ``gpu``, or the stem of ``suites/gpu.json``."""
    return Path(name_or_path).stem if name_or_path.endswith(".json") else name_or_path


def resolve_suite(root: Path, name_or_path: str) -> Path:
    """The manifest file for a suite name (``gpu``) or path (``suites/gpu.json``).

    Raises ``ManifestError`` naming the known suites when there is no such file.
    """
    p = Path(name_or_path)
    candidates = [root / SUITES_DIR / f"{name_or_path}.json"]
    if p.suffix == ".json":
        candidates.insert(0, p if p.is_absolute() else root / p)
    for c in candidates:
        if c.is_file():
            return c
    known = ", ".join(f.stem for f in suite_files(root)) or "none"
    raise ManifestError(
        [
            Problem(
                names.UNKNOWN_SUITE,
                f"{SUITES_DIR}/",
                name_or_path,
                f"no such suite in {root / SUITES_DIR} (known: {known})",
            )
        ]
    )


GLOB_CHARS = re.compile(r"[*?\[]")


def has_glob(pattern: str) -> bool:
    """True when ``pattern`` contains glob syntax."""
    return bool(GLOB_CHARS.search(pattern))


# Unbounded: one entry per distinct manifest pattern. A bounded cache smaller
# than the patterns in use thrashes (inventory time went superlinear past 1,024).
@functools.cache
def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a repository-relative glob by git's wildmatch rules (pathspec): ``*`` and
    ``?`` stay within one path segment, ``**`` spans any number of segments (``a/**/b``
    also matches ``a/b``). ``match`` it against a path: a match may end at a ``/`` (the
    path lies under a directory the glob names).

    Unlike a ``.gitignore`` line, the glob is a path from the repository root even without
    a ``/`` (``*.py`` is the top-level files, not every ``.py`` file), ``!`` and ``#`` are
    characters, and ``*`` matches a newline in a file name (git gives names as they are).
    """
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
        if rx.match(path):
            return True
        parts = path.split("/")
        return any(rx.match("/".join(parts[:k])) for k in range(1, len(parts)))
    return path == pattern or path.startswith(pattern + "/")


def _outside(root: Path, path: str) -> str | None:
    """Why repository-relative ``path`` escapes ``root``, or ``None`` when it stays inside."""
    if path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path):
        return "is absolute; paths are relative to the repository root"
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../"):
        return "is outside the repository"
    if not has_glob(path):
        target = root / norm
        if target.exists() and not target.resolve().is_relative_to(root.resolve()):
            return "leads outside the repository (through a symlink)"
    return None


# --------------------------------------------------------------------------- JSON


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen[k] = v
    return seen


class _DuplicateKey(Exception):
    pass


#: The deepest nesting of arrays and objects a suite file may have. Manifests need a few
#: levels; a document nested past Python's recursion limit would crash the JSON reader, the
#: schema validator and every walk of the document with a ``RecursionError``.
MAX_JSON_DEPTH = 64


def _depth_over(doc: Any, limit: int) -> bool:
    """True when ``doc`` nests arrays / objects deeper than ``limit`` (an explicit stack:
    no recursion, whatever the depth)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend(
                (v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)
            )
    return False


def read_json(path: Path, root: Path) -> Any:
    """Parse a JSON file, rejecting duplicate keys (JSON would keep the last silently) and
    nesting deeper than :data:`MAX_JSON_DEPTH`.

    Raises ``ManifestError`` with rule ``json`` naming the file, and the line and
    column of a syntax error.
    """
    name = rel(path, root)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ManifestError(
            [Problem(names.JSON, name, "", f"cannot read: {e.strerror or e}")]
        ) from e
    except UnicodeDecodeError as e:
        raise ManifestError([Problem(names.JSON, name, "", f"not UTF-8 text: {e}")]) from e
    too_deep = Problem(
        names.JSON, name, "", f"nested deeper than {MAX_JSON_DEPTH} levels of arrays / objects"
    )
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ManifestError(
            [Problem(names.JSON, f"{name}:{e.lineno}:{e.colno}", "", f"not valid JSON: {e.msg}")]
        ) from e
    except _DuplicateKey as e:
        raise ManifestError(
            [Problem(names.JSON, name, "", f"duplicate key {e.args[0]!r} in an object")]
        ) from e
    except RecursionError:
        raise ManifestError([too_deep]) from None
    if _depth_over(doc, MAX_JSON_DEPTH):
        raise ManifestError([too_deep])
    return doc


def pointer(parts: Iterable[Any]) -> str:
    """RFC 6901 JSON pointer for a path of keys and indices (``<root>`` for the document)."""
    out = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return out or "<root>"


@functools.cache
def load_schema() -> dict[str, Any]:
    """The manifest JSON Schema shipped inside this package (``harness/suites/schema.json``):
    every repository validates against the installed harness's."""
    path = Path(__file__).resolve().parent / SCHEMA_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ManifestError(
            [Problem(names.SCHEMA, str(path), "", "schema missing from the harness package")]
        ) from e


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every local ``{"$ref": "#/$defs/x"}`` replaced by the definition
    itself (kept beside any sibling keywords through ``allOf``). The schema has
    no recursive definitions; resolving references once rather than at every
    value validates a 10,000-entry manifest in about half the time."""
    if isinstance(node, list):
        return [_inline_refs(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _inline_refs(v, defs) for k, v in node.items() if k != "$ref"}
    if "$ref" not in node:
        return out
    target = _inline_refs(defs[node["$ref"].removeprefix("#/$defs/")], defs)
    return {**out, "allOf": [target]} if out else target


@functools.lru_cache(maxsize=8)
def _validator(definition: str) -> jsonschema.protocols.Validator:
    schema = load_schema()
    # Validate against one definition so that errors point into it rather
    # than at the root's if/then/else dispatch.
    sub = _inline_refs(schema["$defs"][definition], schema["$defs"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(sub)


def _non_finite(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], float]]:
    """``(path, value)`` of every number in ``doc`` that is not finite.

    Python's JSON reader accepts ``Infinity``, ``-Infinity`` and ``NaN`` (and
    turns ``1e999`` into infinity); JSON Schema cannot reject them (NaN fails
    no comparison), and downstream they become an ``OverflowError`` in a rank
    or invalid JSON in ``harness matrix``; so does an integer too large for a float.
    """
    if is_real(doc) and not is_finite(doc):
        yield at, doc
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from _non_finite(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _non_finite(v, (*at, i))


def validate(doc: Any, root: Path, name: str, definition: str = "manifest") -> list[Problem]:
    """Schema problems of ``doc`` (from file ``name``), each with the JSON pointer
    of the bad value, in document order. A number that is not finite
    (``Infinity``, ``NaN``, an overflowing ``1e999``) is a problem wherever it is."""
    found = [(list(at), f"{value!r} is not a finite number") for at, value in _non_finite(doc)]
    bad_numbers = [at for at, _ in found]
    # One problem per bad value: "-inf is less than the minimum" would only repeat it.
    found += [
        (list(e.absolute_path), e.message)
        for e in _validator(definition).iter_errors(doc)
        if list(e.absolute_path) not in bad_numbers
    ]
    found.sort(key=lambda f: list(map(str, f[0])))
    return [Problem(names.SCHEMA, name, pointer(at), message) for at, message in found]


# --------------------------------------------------------------------------- loading


# Unbounded, like glob_regex: one entry per distinct expression in the manifests.
@functools.cache
def marker_expression(expr: str) -> Any:
    """pytest's own compiled ``-m`` expression for ``expr`` (raises its ``ParseError``)."""
    from _pytest.mark.expression import Expression  # pytest's own -m language

    return Expression.compile(expr)


def _compile_markers(expr: str) -> str | None:
    """Why the ``-m`` expression does not parse, or ``None``."""
    try:
        marker_expression(expr)
    except Exception as e:  # ParseError: keep the message, whatever the class
        return f"bad -m expression {expr!r}: {e}"
    return None


def read_runners(doc: dict[str, Any]) -> tuple[Runner, ...]:
    """The runner classes of a valid manifest document, by ascending cards."""
    raw = doc["runner"]
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for r in items:
        timeout = int(r["timeout_minutes"])
        out.append(
            Runner(
                labels=tuple(r["labels"]),
                cards=int(r["cards"]),
                timeout_minutes=timeout,
                budget_minutes=float(r.get("budget_minutes", timeout * DEFAULT_BUDGET_FRACTION)),
                name=r.get("name") or "-".join(r["labels"]),
                container=r.get("container"),
            )
        )
    return tuple(sorted(out, key=lambda r: r.cards))


def _included(
    raw: dict[str, Any],
    name: str,
    ptr: str,
    root: Path,
    chain: tuple[str, ...],
    problems: list[Problem],
    included: list[str],
) -> list[Entry]:
    """The entries an ``{"include": FILE}`` entry splices in (none, with problems, when it cannot)."""
    target_rel = raw["include"]
    why = _outside(root, target_rel)
    if why:
        problems.append(Problem(names.PATH, name, ptr + "/include", f"{target_rel!r} {why}"))
        return []
    target = root / posixpath.normpath(target_rel)
    tname = rel(target, root)
    if tname in chain:
        cycle = " -> ".join((*chain, tname))
        problems.append(Problem(names.INCLUDE, name, ptr + "/include", f"include cycle: {cycle}"))
        return []
    if not target.is_file():
        problems.append(
            Problem(names.INCLUDE, name, ptr + "/include", f"{target_rel!r} does not exist")
        )
        return []
    try:
        doc = read_json(target, root)
    except ManifestError as e:
        problems.extend(e.problems)
        return []
    kind = "manifest" if isinstance(doc, dict) and "suite" in doc else "caseList"
    found = validate(doc, root, tname, kind)
    if found:
        problems.extend(found)
        return []
    included.append(tname)
    return _expand(doc["entries"], target, root, (*chain, tname), problems, included)


def _case_entry(
    raw: dict[str, Any], name: str, ptr: str, root: Path, problems: list[Problem]
) -> Entry:
    """A case entry, with a problem for each path that leaves the repository and a bad ``markers``."""
    for j, p in enumerate(raw["paths"]):
        why = _outside(root, p.split("::", 1)[0])
        if why:
            problems.append(Problem(names.PATH, name, f"{ptr}/paths/{j}", f"{p!r} {why}"))
    if "markers" in raw and (why := _compile_markers(raw["markers"])):
        problems.append(Problem(names.SCHEMA, name, f"{ptr}/markers", why))
    deps = raw.get("depends_on")
    for j, g in enumerate(deps or ()):
        why = _outside(root, g)
        if why:
            problems.append(Problem(names.PATH, name, f"{ptr}/depends_on/{j}", f"{g!r} {why}"))
    return Entry(
        id=raw["id"],
        paths=tuple(p.rstrip("/") or "." for p in raw["paths"]),
        markers=raw.get("markers"),
        timeout_s=raw.get("timeout_s"),
        estimated_s=float(raw.get("estimated_s", DEFAULT_ESTIMATED_S)),
        depends_on=tuple(deps) if deps is not None else None,
        source=name,
        pointer=ptr,
    )


def _expand(
    entries: list[Any],
    file: Path,
    root: Path,
    chain: tuple[str, ...],
    problems: list[Problem],
    included: list[str],
) -> list[Entry]:
    """The entries of ``file`` in order, includes spliced in (``chain``: the files including it)."""
    name = rel(file, root)
    out: list[Entry] = []
    for i, raw in enumerate(entries):
        ptr = f"/entries/{i}"
        if "include" in raw:
            out.extend(_included(raw, name, ptr, root, chain, problems, included))
        else:
            out.append(_case_entry(raw, name, ptr, root, problems))
    return out


def load_manifest(path: Path, root: Path) -> Manifest:
    """Load, validate and expand one suite manifest.

    Raises ``ManifestError`` listing every problem found: JSON syntax (file,
    line, column), schema violations (file and JSON pointer), a ``suite`` that
    differs from the file name, paths outside the repository, missing or
    cyclic includes, unparsable ``markers``. Duplicate entry ids are not an
    error here; :func:`duplicate_entries` reports them.
    """
    name = rel(path, root)
    doc = read_json(path, root)
    problems = validate(doc, root, name, "manifest")
    if problems:
        raise ManifestError(problems)
    if doc["suite"] != path.stem:
        problems.append(
            Problem(
                names.SCHEMA,
                name,
                "/suite",
                f"suite {doc['suite']!r} must match the file name {path.stem!r}",
            )
        )
    runners = read_runners(doc)
    raw = doc["runner"] if isinstance(doc["runner"], list) else [doc["runner"]]
    if len({json.dumps(r.get("container"), sort_keys=True) for r in raw}) > 1:
        # One shard job runs every class's shards: its container is the suite's.
        problems.append(
            Problem(
                names.SCHEMA,
                name,
                "/runner",
                "every runner class of a suite runs its shard jobs in the same container "
                "(or none): give each the same `container`",
            )
        )
    included: list[str] = []
    entries = _expand(doc["entries"], path, root, (name,), problems, included)
    if problems:
        raise ManifestError(problems)
    return Manifest(
        suite=doc["suite"],
        device=doc["device"],
        runners=runners,
        entries=tuple(entries),
        path=name,
        includes=tuple(dict.fromkeys(included)),
    )


def duplicate_entries(manifest: Manifest) -> list[Problem]:
    """One ``duplicate-entry-id`` problem per entry whose id an earlier entry of the suite already uses."""
    first: dict[str, Entry] = {}
    out = []
    for e in manifest.entries:
        if e.id in first:
            f = first[e.id]
            out.append(
                Problem(
                    names.DUPLICATE_ENTRY_ID,
                    e.source,
                    e.pointer + "/id",
                    f"entry id {e.id!r} of suite {manifest.suite!r} is already used at {f.source} {f.pointer}",
                    manifest.suite,
                )
            )
        else:
            first[e.id] = e
    return out


def load_suites(
    root: Path, names: Iterable[str] | None = None
) -> tuple[list[Manifest], list[Problem]]:
    """Load the named suites (default: every ``suites/*.json``) of the repository at ``root``.

    Returns the manifests that loaded and the problems of those that did not
    (plus duplicate entry ids of those that did). An unknown name is a problem
    with rule ``unknown-suite``.
    """
    problems: list[Problem] = []
    files: list[Path] = []
    if names:
        for n in names:
            try:
                files.append(resolve_suite(root, n))
            except ManifestError as e:
                problems.extend(e.problems)
    else:
        files = suite_files(root)
    manifests = []
    for f in dict.fromkeys(files):
        try:
            m = load_manifest(f, root)
        except ManifestError as e:
            problems.extend(Problem(p.rule, p.file, p.where, p.message, f.stem) for p in e.problems)
            continue
        manifests.append(m)
        problems.extend(duplicate_entries(m))
    return manifests, problems
