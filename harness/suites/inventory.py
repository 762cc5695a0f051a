"""Inventory: which suite entry owns each case pytest collects, and whether every case fits
its runner. Within a suite the first matching entry owns a case; each rule is a function
returning :class:`~harness.suites.manifest.Problem` values, called from :func:`_judge`."""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import importlib.util
import io
import itertools
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from harness import names
from harness.spec import LaunchSpec, is_launched, launch_refusal, spec_for_item
from harness.suites.manifest import (
    SUITES_DIR,
    Entry,
    Manifest,
    ManifestError,
    Problem,
    glob_regex,
    has_glob,
    load_suites,
    marker_expression,
    rel,
    resolve_suite,
    suite_name,
)


@dataclass(frozen=True)
class CollectedCase:
    """One collected case: ``nodeid`` repository-relative; ``spec`` None when its launch
    marker is invalid (``spec_error`` says why); ``marks``: its markers (for ``-m``). A command
    entry's case (:func:`command_case`) has ``command`` set and its manifest as ``file``."""

    nodeid: str
    file: str
    spec: LaunchSpec | None
    launched: bool
    device_param: str | None
    marks: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    spec_error: str | None = None
    #: The accelerator and cards an entry gave this plain case (:func:`as_owned`); None: its own.
    entry_device: str | None = None
    entry_cards: int = 0
    command: tuple[str, ...] | None = None

    @property
    def device(self) -> str:
        """The device the case runs on (``cpu`` when its spec is invalid)."""
        if self.entry_device is not None:
            return self.entry_device
        return self.spec.device if self.spec else "cpu"

    @property
    def cards(self) -> int:
        if self.entry_device is not None:
            return self.entry_cards
        return self.spec.cards if self.spec else 0

    @property
    def plain(self) -> bool:
        """No launch marker, no ``device`` parameter: an entry's ``device`` decides."""
        return self.spec is not None and not self.launched and self.device_param is None

    @property
    def nproc(self) -> int:
        return self.spec.nproc if self.spec else 1

    @property
    def nnodes(self) -> int:
        return self.spec.nnodes if self.spec else 1


@dataclass
class SuiteInventory:
    """The outcome of :func:`build_inventory`: ``owners[nodeid]`` lists ``(suite, entry id)``
    pairs; ``problems`` every rule violation found (empty: the inventory is clean)."""

    root: Path
    manifests: dict[str, Manifest]
    cases: list[CollectedCase]
    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    #: Test files (or folders) that yield no case -> why (an import error, a module-level skip).
    unloadable: dict[str, str] = field(default_factory=dict)

    def suite_cases(self, suite: str) -> list[tuple[CollectedCase, Entry]]:
        """The cases ``suite`` owns with their owning entries, in collection order; then one case
        per :attr:`unloadable` file an entry names (node id: the file), so a run reports it."""
        entries = self.manifests[suite].entries
        by_id = {e.id: e for e in reversed(entries)}  # the first entry of each id
        out = [
            (as_owned(c, by_id[eid]), by_id[eid])
            for c in self.cases
            for s, eid in self.owners.get(c.nodeid, ())
            if s == suite
        ]
        for f in sorted(self.unloadable):
            owner = next((e for e in entries if EntryIndex([e]).covers_file(f)), None)
            if owner is not None:
                out.append((as_owned(CollectedCase(f, f, LaunchSpec(), False, None), owner), owner))
        return out

    def as_dict(self, suites: Iterable[str] | None = None) -> dict[str, Any]:
        """JSON form ``{"cases", "errors", "warnings"}`` (warnings: ``names.WARNING_RULES``,
        which do not fail the inventory), limited to ``suites`` when given."""
        wanted = set(suites) if suites is not None else None
        # Each case as its owning entries (``suite:id``) run it: one row per (device, cards).
        rows: list[tuple[CollectedCase, list[str]]] = []
        by_id = {(m.suite, e.id): e for m in self.manifests.values() for e in reversed(m.entries)}
        for c in self.cases:
            owners = self.owners.get(c.nodeid, [])
            if not owners:
                if wanted is None:
                    rows.append((c, []))
                continue
            views: dict[tuple[str, int], tuple[CollectedCase, list[str]]] = {}
            for s, eid in owners:
                if wanted is not None and s not in wanted:
                    continue
                seen = as_owned(c, by_id[s, eid])
                views.setdefault((seen.device, seen.cards), (seen, []))[1].append(f"{s}:{eid}")
            rows += views.values()
        cases = [
            {
                "nodeid": c.nodeid,
                "device": c.device,
                "nproc": c.nproc,
                "cards": c.cards,
                "nnodes": c.nnodes,
                "launched": c.launched,
                "entries": entries,
                **({"command": list(c.command)} if c.command is not None else {}),
            }
            for c, entries in rows
        ]
        return {
            "cases": cases,
            "errors": [asdict(p) for p in self.problems if p.rule not in names.WARNING_RULES],
            "warnings": [asdict(p) for p in self.problems if p.rule in names.WARNING_RULES],
        }


def as_owned(case: CollectedCase, entry: Entry) -> CollectedCase:
    """``case`` as ``entry`` runs it: a :attr:`~CollectedCase.plain` case of an accelerator
    entry runs on that accelerator with the entry's ``cards``; any other keeps its own."""
    if entry.accelerator is None or not case.plain:
        return case
    return replace(case, entry_device=entry.accelerator, entry_cards=entry.cards)


# A traceback frame: ``path:LINE: in ...`` (pytest's form) or ``File "path", line LINE``.
_FRAME = re.compile(
    r'^(?:E\s+)?File "(?P<f1>[^"]+)", line (?P<l1>\d+)|^(?P<f2>[^\s<][^:\n]*):(?P<l2>\d+): in ',
    re.M,
)


def _collection_error(report: Any, root: Path) -> Problem:
    """A failed collect report's problem: the file's line on the stack, where deeper it raised."""
    text = str(report.longrepr).strip()
    lines = text.splitlines()
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    message = errors[-1] if errors else (lines[-1] if lines else "collection failed")
    file = report.nodeid.split("::", 1)[0] or "."
    frames = []
    for m in _FRAME.finditer(text):
        path, line = (m["f1"], m["l1"]) if m["f1"] else (m["f2"], m["l2"])
        name = rel(root / path, root)  # an absolute path stays itself
        if not os.path.isabs(name):
            frames.append((name, line))
    own = [f"line {line}" for name, line in frames if name == file][-1:]
    deeper = [f"raised at {n}:{line}" for n, line in frames[-1:] if n != file]
    raised_in = [name for name, _ in frames[-1:]]
    absent = _absent_module(file, message, root, raised_in)
    rule = names.MISSING_DEPENDENCY if absent else names.COLLECTION_ERROR
    return Problem(rule, file, ", ".join(own + deeper), message)


# Only the top-level name of "No module named 'x.y'" tells a distribution that is not
# installed from a missing submodule of an installed one or of the repository's own code.
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '(?P<top>[^'.]+)[^']*'")


def _absent_module(file: str, message: str, root: Path, raised_in: Sequence[str]) -> str | None:
    """The uninstalled top-level module that kept test module ``file`` from importing (not one
    of the repository's own, from ``file``'s or ``raised_in``'s folder up to ``root``)."""
    m = _NO_MODULE.fullmatch(message)
    if m is None or not is_test_module(file):
        return None
    top = m["top"]
    for start in (file, *raised_in):
        for folder in (root / start).parents:
            if (folder / f"{top}.py").exists() or (folder / top / "__init__.py").exists():
                return None
            if folder == root:
                break
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = True  # present but broken: the error is the file's, not the environment's
    return None if found else top


def _missing_dependencies(problems: Iterable[Problem]) -> list[Problem]:
    """``problems`` with each absent module's ``missing-dependency`` problems merged into one."""
    out: list[Problem | str] = []
    files: dict[str, list[str]] = {}
    for p in problems:
        m = _NO_MODULE.fullmatch(p.message)
        if p.rule != names.MISSING_DEPENDENCY or m is None:
            out.append(p)
        elif m["top"] in files:
            files[m["top"]].append(p.file)
        else:
            files[m["top"]] = [p.file]
            out.append(m["top"])
    return [
        p
        if isinstance(p, Problem)
        else Problem(
            names.MISSING_DEPENDENCY,
            files[p][0],
            "",
            f"module {p!r} is not installed for {sys.executable}: {len(files[p])} test "
            "file(s) import it, so their cases are not listed here and their entries are "
            f"taken to own them: {', '.join(files[p])}. Install the tests' dependencies to "
            "check them; `harness run` fails them until then",
        )
        for p in out
    ]


@dataclass(eq=False)  # compared by identity: a registered pytest plugin
class Collection:
    """The plugin recording what one pytest collection saw: ``files``, the test files;
    ``scope``, the paths collected from; ``inipath``, the configuration file used."""

    root: Path = Path()
    cases: list[CollectedCase] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    scope: list[str] = field(default_factory=list)
    inipath: Path | None = None
    #: Test files and folders skipped as a whole at collection: why.
    skipped: dict[str, str] = field(default_factory=dict)
    #: The ``testpaths``, ``norecursedirs`` and ``python_files`` of the configuration.
    layout: dict[str, list[str]] = field(default_factory=dict)
    failed: bool = False  # pytest failed the whole session: ownership cannot be judged
    interrupted: bool = False  # Ctrl-C
    exited: str = ""  # pytest.exit during collection: why

    def extend(self, other: Collection) -> None:
        """Add another run's findings (cases already seen are not repeated)."""
        seen = {c.nodeid for c in self.cases}
        self.cases += [c for c in other.cases if c.nodeid not in seen]
        self.problems += other.problems
        self.skipped.update(other.skipped)
        self.files = list(dict.fromkeys([*self.files, *other.files]))
        self.failed = self.failed or other.failed

    def pytest_configure(self, config: Any) -> None:
        self.inipath = config.inipath
        self.layout = {
            k: list(config.getini(k)) for k in ("testpaths", "norecursedirs", "python_files")
        }

    def pytest_keyboard_interrupt(self, excinfo: Any) -> None:
        if isinstance(excinfo.value, KeyboardInterrupt):  # a signal: the caller asked to stop
            self.interrupted = True
        else:  # pytest.exit in a conftest's hook or a test module: the collection is cut short
            self.exited = f"{excinfo.typename}: {excinfo.value}"

    @pytest.hookimpl(wrapper=True)
    def pytest_load_initial_conftests(self) -> Any:
        # A named folder's conftest skipping at module level escapes here as a traceback;
        # dropped, collection loads it again and reports the folder skipped (as selection does).
        try:
            return (yield)
        except pytest.skip.Exception:
            return None

    def pytest_collectstart(self, collector: Any) -> None:
        if isinstance(collector, pytest.File):
            self.files.append(rel(Path(str(collector.path)), self.root))

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            problem = _collection_error(report, self.root)
            if problem not in self.problems:  # a failing conftest spoils each node below it
                self.problems.append(problem)
        elif report.skipped and (
            is_test_module(report.nodeid)  # or a folder whose conftest skips at module level:
            or (
                "::" not in report.nodeid
                and report.nodeid not in ("", ".")
                and (self.root / report.nodeid).is_dir()
            )
        ):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            self.skipped[report.nodeid] = str(reason).removeprefix("Skipped: ")

    def pytest_collection_finish(self, session: Any) -> None:
        self.scope = [rel(Path(a.split("::", 1)[0]), self.root) for a in session.config.args]
        if not self.cases:  # (harness run's plan added them as it planned)
            self.add_items(session.items)

    def add_items(self, items: Iterable[Any]) -> None:
        """Record pytest's ``items`` as cases (command items aside: :func:`command_case`)."""
        self.cases += [_case(i, self.root) for i in items if not hasattr(i, "harness_case_id")]


def is_test_module(nodeid: str) -> bool:
    """True when a collector's node id is a test module (a ``.py`` file, not a conftest)."""
    return "::" not in nodeid and nodeid.endswith(".py") and not nodeid.endswith("conftest.py")


def case_id(item: Any, root: Path) -> str:
    """A collected item's node id relative to ``root`` (pytest's own is relative to its rootdir);
    a command case's own id (``<suite>::<entry id>``, its ``harness_case_id``)."""
    own = getattr(item, "harness_case_id", None)
    if isinstance(own, str):
        return own
    path = rel(Path(str(item.path)), root)
    _, sep, tail = item.nodeid.partition("::")
    return f"{path}::{tail}" if sep else path


def _case(item: Any, root: Path) -> CollectedCase:
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("device") if callspec is not None else None
    plain = (str, int, bool, type(None))  # what an -m expression can compare
    marks = tuple(
        (m.name, tuple(sorted((k, v) for k, v in m.kwargs.items() if isinstance(v, plain))))
        for m in item.iter_markers()
    )
    nodeid, launched = case_id(item, root), is_launched(item)
    try:
        spec, err = spec_for_item(item), None
    except (ValueError, TypeError) as e:
        spec, err = None, str(e)
    # A launched case the plugin refuses to run is not a case of nproc ranks.
    if spec is not None and launched and (refusal := launch_refusal(item)) is not None:
        spec, err = None, refusal
    return CollectedCase(
        nodeid=nodeid,
        file=nodeid.split("::", 1)[0],
        spec=spec,
        launched=launched,
        device_param=param if isinstance(param, str) else None,
        marks=marks,
        spec_error=err,
    )


def autoload_disabled(args: Sequence[str] = ()) -> bool:
    """True when pytest will not load plugins from entry points
    (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``, or ``--disable-plugin-autoload`` in ``args``)."""
    return (
        bool(os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"))
        or "--disable-plugin-autoload" in args
    )


#: The pytest plugins the harness itself needs in a pytest process: xdist (for ``-n``) and the launch plugin.
NEEDED_PLUGINS = ("xdist.plugin", "harness.launcher.plugin")


def plugin_args(args: Sequence[str] = ()) -> list[str]:
    """``-p`` arguments loading the installed :data:`NEEDED_PLUGINS` when autoloading is
    disabled (else none), by entry-point name where one is declared, else by module."""
    if not autoload_disabled(args):
        return []
    from importlib.metadata import entry_points

    by_module = {ep.value: ep.name for ep in entry_points(group="pytest11")}
    found = [m for m in NEEDED_PLUGINS if importlib.util.find_spec(m.split(".", 1)[0])]
    return [arg for m in found for arg in ("-p", by_module.get(m, m))]


def collect(root: Path, targets: Sequence[str] | None) -> Collection:
    """Collect with pytest, in-process and collect-only, from ``root`` with the repository's
    configuration: ``targets`` (repository-relative), or when ``None`` what pytest collects
    by default there. Problems: files that failed to import (with the line), or pytest
    itself failing (with the tail of its output)."""
    if targets is not None and not targets:
        return Collection()
    rec = Collection(root)
    # No test code runs, so unraisableexception's forced garbage collections at exit only
    # cost time; the harness was imported before pytest could mark it for rewriting, and a
    # project's `filterwarnings = error` must not make that notice a failure.
    args = [
        *("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception"),
        *("--continue-on-collection-errors", f"--rootdir={root}", *plugin_args()),
        *("-W", "ignore::pytest.PytestAssertRewriteWarning"),
        *(str(root / t) for t in targets or ()),
    ]
    # The caller's PYTEST_ADDOPTS is for running tests (a --junitxml there would be
    # overwritten by an empty report). The working directory and sys.path are those of
    # `python -m pytest` started at the root, where testpaths apply and tests import alike.
    addopts = os.environ.pop("PYTEST_ADDOPTS", None)
    out, here, added = io.StringIO(), os.getcwd(), str(root) not in sys.path
    # The node graph lives to the end: the cyclic collector would walk it again and again.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    os.chdir(root)
    if added:
        sys.path.insert(0, str(root))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = pytest.main(args, plugins=[rec])
            except Exception as exc:  # before its session: a config warning made an error
                print(f"{type(exc).__name__}: {exc}", file=out)
                code = pytest.ExitCode.INTERNAL_ERROR
            except SystemExit as exc:  # sys.exit() in a conftest pytest loads before its session
                print(f"SystemExit({exc.code!r}) while pytest loaded the project", file=out)
                code = pytest.ExitCode.INTERNAL_ERROR
    finally:
        os.chdir(here)
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(str(root))
        if gc_was_enabled:
            gc.enable()
        if addopts is not None:
            os.environ["PYTEST_ADDOPTS"] = addopts
    if rec.interrupted:
        raise KeyboardInterrupt  # pytest reported it and returned; the caller asked to stop
    # 0: collected, 1: some collection error (recorded above), 5: nothing collected.
    rec.failed = bool(rec.exited) or int(code) not in (0, 1, 5)
    if rec.failed:
        tail = "\n".join(out.getvalue().strip().splitlines()[-15:])
        why = f"pytest exited with {int(code)}:\n{tail}"
        why = f"pytest.exit during collection ({rec.exited})" if rec.exited else why
        rec.problems.append(Problem(names.COLLECTION_ERROR, ".", "", why))
    return rec


def _outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` but those under another of them, sorted."""
    kept: set[str] = set()
    for p in sorted(paths, key=lambda p: (p.count("/"), p)):
        if kept.isdisjoint(_ancestors(p)):
            kept.add(p)
    return sorted(kept)


def entry_targets(
    root: Path, manifests: Iterable[Manifest], *, skip: set[str] | None = None
) -> list[str]:
    """The fewest collection arguments covering every entry path of ``manifests`` but those in
    ``skip`` (globs expanded)."""
    paths: set[str] = set()
    patterns: set[str] = set()
    for m in manifests:
        for e in m.entries:
            for p in e.paths:
                file_part = p.split("::", 1)[0]
                if has_glob(file_part):
                    patterns.add(file_part)
                elif os.path.lexists(root / file_part):
                    paths.add(file_part)
    # Globs: the .py files and folders they match, in one walk of each literal top folder
    # (hidden ones aside, nothing below a match).
    index = EntryIndex([Entry("", tuple(patterns), None, None, 0.0, None, "", "")])
    tops = {
        "/".join(itertools.takewhile(lambda s: not has_glob(s), p.split("/"))) or "."
        for p in patterns
    }
    for top in _outermost(tops):
        for dirpath, dirnames, filenames in os.walk(root / top):
            base = rel(Path(dirpath), root)
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files = [f for f in filenames if f.endswith(".py") and not f.startswith(".")]
            hits = {
                n
                for n in [*dirnames, *files]
                if index.covers_file(f"{base}/{n}".removeprefix("./"))
            }
            paths.update(f"{base}/{n}".removeprefix("./") for n in hits)
            dirnames[:] = [d for d in dirnames if d not in hits]
    return _outermost(paths - (skip or set()))


def _markers(case: CollectedCase) -> Any:
    """A case's markers as pytest's ``-m`` expressions evaluate them (a matcher)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, kwargs in case.marks:
        by_name.setdefault(name, []).append(dict(kwargs))
    return lambda name, /, **kw: any(
        all(m.get(k, object()) == v for k, v in kw.items()) for m in by_name.get(name, ())
    )


def _literal_segment(pattern: str) -> str | None:
    """The last segment of a glob without glob syntax: every path the glob matches has it."""
    literal = [part for part in pattern.split("/") if not has_glob(part)]
    return literal[-1] if literal else None


def _ancestors(path: str) -> list[str]:
    """``a/b/c`` -> ``., a, a/b, a/b/c``."""
    parts = path.split("/")
    return [".", *("/".join(parts[:k]) for k in range(1, len(parts) + 1))]


def _id_prefixes(nodeid: str) -> list[str]:
    """The id, and the id cut before each ``::`` and ``[``: what a selector may name."""
    cuts = {i for i in range(1, len(nodeid)) if nodeid.startswith("::", i) or nodeid[i] == "["}
    return [nodeid, *(nodeid[:i] for i in sorted(cuts))]


class EntryIndex:
    """The entries of one manifest, indexed so that matching a case costs time in its path
    depth, not in the number of entries (``scripts/bench/inventory.py``): node ids and
    paths are looked up, globs tried only on paths holding their last literal segment."""

    def __init__(self, entries: Sequence[Entry]):
        self.entries = list(entries)
        self.by_id: dict[str, list[int]] = {}
        self.by_path: dict[str, list[int]] = {}
        self.globs: dict[str | None, list[tuple[re.Pattern[str], int]]] = {}
        self.markers: dict[int, Any] = {}
        self.id_files: set[str] = set()
        for i, e in enumerate(self.entries):
            for sel in e.paths:
                if "::" in sel:
                    self.by_id.setdefault(sel, []).append(i)
                    self.id_files.add(sel.split("::", 1)[0])
                elif has_glob(sel):
                    self.globs.setdefault(_literal_segment(sel), []).append((glob_regex(sel), i))
                else:
                    self.by_path.setdefault(sel, []).append(i)
            if e.markers is not None:
                self.markers[i] = marker_expression(e.markers)

    def _selecting(self, case: CollectedCase) -> dict[int, bool]:
        """Entry position -> whether it names the case by node id, for each entry selecting it."""
        hits: dict[int, bool] = {}
        for prefix in _id_prefixes(case.nodeid):
            for i in self.by_id.get(prefix, ()):
                hits[i] = True
        dirs = _ancestors(case.file)
        for d in dirs:
            for i in self.by_path.get(d, ()):
                hits.setdefault(i, False)
        for rx, i in self._globs_for(case.file):
            if i not in hits and any(rx.match(a) for a in dirs[1:]):
                hits[i] = False
        return hits

    def _globs_for(self, path: str) -> Iterator[tuple[re.Pattern[str], int]]:
        """The globs that can match ``path`` or a folder above it."""
        yield from self.globs.get(None, ())
        for segment in set(path.split("/")):
            yield from self.globs.get(segment, ())

    def covers_file(self, path: str) -> bool:
        """True when some entry's path (or a node id's file) is ``path`` or a folder above it."""
        dirs = _ancestors(path)
        if any(d in self.by_path or d in self.id_files for d in dirs):
            return True
        return any(rx.match(a) for rx, _ in self._globs_for(path) for a in dirs[1:])

    def matching(self, case: CollectedCase, suite_device: str) -> list[Entry]:
        """The entries (in manifest order) that select ``case`` in a suite on ``suite_device``."""
        out = []
        marks = None
        for i, by_id in sorted(self._selecting(case).items()):
            # Another device's variant of a shared test is that device's suite's case.
            if not by_id and as_owned(case, self.entries[i]).device != suite_device:
                continue
            if i in self.markers:
                marks = marks or _markers(case)
                if not self.markers[i].evaluate(marks):
                    continue
            out.append(self.entries[i])
        return out


def _fit_problems(m: Manifest, entry: Entry, case: CollectedCase) -> list[Problem]:
    where = f"{case.nodeid} (entry {entry.id!r} at {entry.source} {entry.pointer})"
    case = as_owned(case, entry)
    device, cards = case.device, case.cards
    found = []
    if cards > 0 and "cpu" in (device, m.device):
        why = f"case on {device} asks for {cards} card(s) in cpu suite {m.suite!r}"
        found.append((names.CPU_CASE_NEEDS_CARDS, why))
    elif m.device != "cpu" and cards < 1:
        why = f"{device} case needs no card, but {m.device} suite {m.suite!r} runs on accelerator runners"
        found.append((names.ACCELERATOR_CASE_WITHOUT_CARDS, why))
    elif m.device != device:
        found.append((names.WRONG_DEVICE, f"{device} case in {m.device} suite {m.suite!r}"))
    if cards > m.max_cards:
        why = (
            f"case needs {cards} card(s); the largest runner of suite {m.suite!r} has {m.max_cards}"
        )
        found.append((names.CASE_EXCEEDS_RUNNER_CARDS, why))
    if case.nnodes > m.max_nodes:
        why = (
            f"case needs {case.nnodes} nodes; the runners of suite {m.suite!r} provide at most "
            f"{m.max_nodes} (a runner's `nodes`)"
        )
        found.append((names.CASE_EXCEEDS_RUNNER_NODES, why))
    return [Problem(rule, m.path, where, why, m.suite) for rule, why in found]


@dataclass
class _Scope:
    """Which manifests an inventory reads (all of them) and judges (the selected ones);
    ``manifests_ok``: every manifest loaded (else ownership is noise)."""

    all: list[Manifest]
    selected: list[Manifest]
    problems: list[Problem]
    manifests_ok: bool


def _load_scope(root: Path, suites: Iterable[str] | None) -> _Scope:
    """Load every manifest, keep the problems of the selected suites."""
    manifests, problems = load_suites(root)
    if not manifests and not problems:  # never "0 case(s), 0 problem(s)"
        why = (
            f"has no suite manifests (root {root}, the nearest folder holding a {SUITES_DIR}/)"
            if (root / SUITES_DIR).is_dir()
            else f"does not exist in {root}"
        )
        why += ": write one (`harness init`) or pass --root"
        problems = [Problem(names.NO_SUITES, f"{SUITES_DIR}/", "", why)]
    ok = not any(p.rule in names.MANIFEST_RULES for p in problems)
    if not suites:
        return _Scope(manifests, manifests, problems, ok)
    wanted = {suite_name(s) for s in suites}  # a suite named by path (suites/x.json): its stem
    problems = [p for p in problems if p.suite in wanted]
    for s in suites:
        try:
            resolve_suite(root, s)
        except ManifestError as e:
            problems += e.problems
    return _Scope(manifests, [m for m in manifests if m.suite in wanted], problems, ok)


def command_case(m: Manifest, entry: Entry) -> CollectedCase:
    """The one case of command entry ``entry`` of suite ``m``: node id ``<suite>::<entry id>``,
    on the entry's device (else the suite's) with its ``cards`` (none on cpu)."""
    device = entry.device or m.device
    spec = LaunchSpec(device, 1 if device == "cpu" else entry.cards)
    nodeid = f"{m.suite}::{entry.id}"
    return CollectedCase(nodeid, entry.source, spec, False, None, command=entry.command)


def _assign_owners(inv: SuiteInventory, m: Manifest, judged: bool, idle: bool = True) -> None:
    """Record each case's first matching entry of ``m``; if ``judged``, the fit (and ``idle``:
    entry-matches-nothing) problems."""
    index = EntryIndex(m.entries)
    owned_by = dict.fromkeys((e.id for e in m.entries), 0)
    for e in m.entries:
        if e.command is not None and f"{m.suite}::{e.id}" not in inv.owners:
            case = command_case(m, e)
            inv.cases.append(case)
            inv.owners[case.nodeid] = [(m.suite, e.id)]
            owned_by[e.id] = 1
            if judged:
                inv.problems.extend(_fit_problems(m, e, case))
    first_owner: dict[str, str] = {}  # entry id -> the earlier entry owning what it matches
    for c in inv.cases:
        hits = index.matching(c, m.device) if c.spec is not None and c.command is None else []
        if not hits:
            continue
        owned_by[hits[0].id] += 1
        for e in hits[1:]:
            first_owner.setdefault(e.id, hits[0].id)
        inv.owners.setdefault(c.nodeid, []).append((m.suite, hits[0].id))
        if judged:
            inv.problems.extend(_fit_problems(m, hits[0], c))
    if not (judged and idle):
        return
    # A run reports an entry naming a file that fails to import or skips (failed, skipped).
    for e in m.entries:
        if not owned_by[e.id] and _covers_unloadable(inv, e):
            owned_by[e.id] = 1
    reported: set[str] = set()  # once per id
    for e in m.entries:
        if owned_by[e.id] or e.id in reported:
            continue
        reported.add(e.id)
        if e.id in first_owner:
            why = f"every case it matches is owned by the earlier entry {first_owner[e.id]!r}"
        else:
            why = f"its paths {list(e.paths)} match no {m.device} case" + (
                f" with markers {e.markers!r}" if e.markers else ""
            )
        inv.problems.append(_idle(m, e, e.pointer, why))
    inv.problems.extend(_dead_paths(inv, m, owned_by))


def _idle(m: Manifest, e: Entry, where: str, why: str) -> Problem:
    where, why = f"{where} (entry {e.id!r})", f"suite {m.suite!r}: {why}"
    return Problem(names.ENTRY_MATCHES_NOTHING, e.source, where, why, m.suite)


def _covers_unloadable(inv: SuiteInventory, entry: Entry) -> bool:
    return any(EntryIndex([entry]).covers_file(f) for f in inv.unloadable)


def _dead_paths(inv: SuiteInventory, m: Manifest, owned_by: dict[str, int]) -> list[Problem]:
    """``entry-matches-nothing`` for each path of an owning entry that selects nothing."""
    paths = [
        (e, j, replace(e, paths=(p,), markers=None))
        for e in m.entries
        if owned_by[e.id]
        for j, p in enumerate(e.paths)
    ]
    index = EntryIndex([single for _, _, single in paths])
    alive = {i for c in inv.cases if c.command is None for i in index._selecting(c)}
    out = []
    for i, (e, j, single) in enumerate(paths):
        if i in alive or _covers_unloadable(inv, single):
            continue
        p = single.paths[0]
        absent = not has_glob(p) and not (inv.root / p.split("::", 1)[0]).exists()
        why = f"its path {p!r} matches nothing: " + (
            "no such file or folder" if absent else "no collected case"
        )
        out.append(_idle(m, e, f"{e.pointer}/paths/{j}", why))
    return out


def _ownership_problems(
    inv: SuiteInventory, manifests: Sequence[Manifest], files: Sequence[str]
) -> list[Problem]:
    """``unowned-file`` for each test file no case of which is owned, else ``unowned-case``."""
    by_file: dict[str, list[CollectedCase]] = {}
    for c in inv.cases:
        by_file.setdefault(c.file, []).append(c)
    covered = EntryIndex([e for m in manifests for e in m.entries])
    unowned_files = [
        f
        for f in sorted(set(files))
        if not any(c.nodeid in inv.owners for c in by_file.get(f, []))
        # A file collecting nothing here (a module-level skip), or only cases whose launch
        # marker is invalid (each a bad-launch-spec problem), is its entry's.
        and not (all(c.spec is None for c in by_file.get(f, [])) and covered.covers_file(f))
    ]
    why = "test file owned by no suite entry: add it to a suite in suites/"
    out = [Problem(names.UNOWNED_FILE, f, "", why) for f in unowned_files]
    for c in inv.cases:
        if c.spec is None or c.nodeid in inv.owners or c.file in unowned_files:
            continue
        mine = [m.path for m in manifests if m.device == c.device]
        hint = (
            f"add its file or node id to an entry of {' or '.join(mine)}"
            if mine
            else f"no suite runs {c.device} cases: add one (`harness init --accelerators {c.device}`)"
        )
        why = f"{c.device} case owned by no suite entry: {hint}"
        out.append(Problem(names.UNOWNED_CASE, c.file, c.nodeid, why))
    return out


def _hidden_problems(
    root: Path, layout: dict[str, list[str]], collected: set[str]
) -> list[Problem]:
    """A warning for each test file not ``collected`` that ``norecursedirs`` hides in testpaths."""
    patterns = [p for p in layout.get("norecursedirs", ()) if p != ".*"]
    python_files = layout.get("python_files", ())
    hidden: dict[str, str] = {}
    for top in layout.get("testpaths", ()):
        for dirpath, dirnames, _ in os.walk(root / top):
            keep = []
            for d in dirnames:
                if d.startswith(".") or (Path(dirpath, d) / "pyvenv.cfg").exists():
                    continue
                pat = next((p for p in patterns if fnmatch.fnmatch(d, p)), None)
                if pat is None:
                    keep.append(d)
                    continue
                for sub, subdirs, files in os.walk(Path(dirpath, d)):
                    subdirs[:] = [s for s in subdirs if not s.startswith(".")]
                    for name in files:
                        if any(fnmatch.fnmatch(name, g) for g in python_files):
                            hidden.setdefault(rel(Path(sub, name), root), pat)
            dirnames[:] = keep
    why = (
        "lies under a directory that norecursedirs pattern {!r} hides from pytest inside "
        "testpaths: it never runs; name it in a suite entry (harness run collects entry "
        "paths by name) or change norecursedirs"
    )
    return [
        Problem(names.HIDDEN_TESTS, f, "", why.format(pat))
        for f, pat in sorted(hidden.items())
        if f not in collected
    ]


def _outside_problems(root: Path, files: Iterable[str]) -> list[Problem]:
    """``symlink-outside-repository`` for each collected test file that links outside."""
    real_root = root.resolve()
    out = []
    for f in sorted(set(files)):
        target = (root / f).resolve()
        if not os.path.isabs(f) and not target.is_relative_to(real_root):
            why = (
                f"is a symlink to {target}, outside the repository: a checkout elsewhere (CI) "
                "will not have it and --changed-from cannot see its changes; move the test "
                "into the repository"
            )
            out.append(Problem(names.SYMLINK_OUTSIDE_REPOSITORY, f, "", why))
    return out


def build_inventory(
    root: Path, suites: Iterable[str] | None = None, *, check_ownership: bool = True
) -> SuiteInventory:
    """Collect the repository's tests and check them against its suites (``suites``: those
    judged, default all). With ``check_ownership`` pytest collects what it does by default
    plus every entry path, and each test file must be owned by *some* suite; without it,
    only the selected suites' entry paths. No suites at all: a ``no-suites`` problem."""
    root = root.resolve()
    scope = _load_scope(root, suites)
    if any(p.rule == names.NO_SUITES for p in scope.problems):
        # Outside a repository a collection would import every test file below the cwd.
        return SuiteInventory(root=root, manifests={}, cases=[], problems=scope.problems)
    found = collect(root, None if check_ownership else entry_targets(root, scope.selected))
    if check_ownership:
        # Entry paths pytest does not collect by default are collected by name, as `harness
        # run` does; only folders above a collected file are skipped (tests/dist under tests
        # is not).
        seen = {a for f in found.files for a in _ancestors(f)}
        if extra := entry_targets(root, scope.all, skip=seen):
            found.extend(collect(root, extra))
    return _judge(root, scope, found, check_ownership=check_ownership)


def run_inventory(
    root: Path, manifest: Manifest, found: Collection, *, whole: bool
) -> SuiteInventory:
    """The inventory of one suite from the collection of ``harness run``'s own pytest session
    (``found``): :func:`build_inventory`'s rules without ownership; ``entry-matches-nothing``
    only where the collection saw the ``whole`` suite."""
    scope = _Scope([manifest], [manifest], [], True)
    return _judge(root, scope, found, check_ownership=False, idle=whole)


def load_suite_manifest(root: Path, suite: str) -> tuple[Manifest | None, list[Problem]]:
    """The manifest of ``suite`` (a name or a path) and the blocking problems found loading it:
    what keeps ``harness run`` from starting before anything is collected."""
    scope = _load_scope(root.resolve(), [suite])  # the problems and manifests of ``suite`` only
    problems = [p for p in scope.problems if p.rule in names.BLOCKING_RULES]
    return next(iter(scope.selected), None), problems


def blocking_problems(inv: SuiteInventory, suite: str) -> list[Problem]:
    """The problems of ``inv`` that keep ``harness run`` / ``matrix`` from planning ``suite``:
    ``BLOCKING_RULES`` of that suite or of none, save a test file that fails to import (a run
    reports it as its entry's failure)."""
    return [
        p
        for p in inv.problems
        if p.suite in (suite, None)
        and p.rule in names.BLOCKING_RULES
        and not (p.rule == names.COLLECTION_ERROR and p.file in inv.unloadable)
    ]


def _judge(
    root: Path, scope: _Scope, found: Collection, *, check_ownership: bool, idle: bool = True
) -> SuiteInventory:
    """What ``found`` collected, held against the manifests of ``scope``."""
    unloadable = {
        p.file: p.message
        for p in found.problems
        if p.rule in (names.COLLECTION_ERROR, names.MISSING_DEPENDENCY) and is_test_module(p.file)
    }
    spec_problems = [
        Problem(names.BAD_LAUNCH_SPEC, c.file, c.nodeid, str(c.spec_error))
        for c in found.cases
        if c.spec is None
    ]
    inv = SuiteInventory(
        root=root,
        manifests={m.suite: m for m in scope.all},
        cases=found.cases,
        # One problem once, though collection may run twice (testpaths, then entry paths).
        problems=_missing_dependencies(
            dict.fromkeys([*scope.problems, *found.problems, *spec_problems])
        ),
        unloadable={**found.skipped, **unloadable},
    )
    inv.problems.extend(_outside_problems(root, {*found.files, *(c.file for c in found.cases)}))
    # After a session-wide failure every entry would "match nothing": noise hiding the cause.
    judged = set() if found.failed else {m.suite for m in scope.selected}
    for m in scope.all if check_ownership else scope.selected:
        _assign_owners(inv, m, m.suite in judged, idle)
    if check_ownership and scope.manifests_ok and not found.failed:
        inv.problems.extend(_ownership_problems(inv, scope.all, found.files))
        inv.problems.extend(_hidden_problems(root, found.layout, set(found.files)))
    return inv
