"""Inventory: which suite entry owns each test case, and whether every case fits its runner.

Cases come from pytest's own collection, in-process and collect-only from the repository
root with its configuration (:func:`collect`); entry paths pytest does not collect by
default are collected by name, as ``harness run`` will. A device-parametrized or launched
case belongs to the suite on its device (another device's suite skips it silently unless
an entry names it by node id); within a suite the *first* matching entry owns a case.
Matching is indexed (:class:`EntryIndex`), linear in cases and entries
(``scripts/bench/inventory.py``). Each rule is a function returning
:class:`~harness.suites.manifest.Problem` values, called from :func:`build_inventory`; rule
names, and which block ``harness run`` / ``matrix`` or only warn, live in ``harness.names``.
"""

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
    """One collected test case: ``nodeid`` repository-relative; ``spec`` None when its launch
    marker is invalid (``spec_error`` says why); ``marks``, its markers' names and keyword
    arguments (for ``-m``); ``device_param``, its ``device`` parameter, if any. A command
    entry's case (:func:`command_case`) has its argv as ``command``, ``<suite>::<entry id>``
    as node id and its manifest as ``file``."""

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
        """Cards the case needs."""
        if self.entry_device is not None:
            return self.entry_cards
        return self.spec.cards if self.spec else 0

    @property
    def plain(self) -> bool:
        """Whether the case says nothing of its device: no launch marker, no ``device``
        parameter (an entry's ``device`` decides where it runs)."""
        return self.spec is not None and not self.launched and self.device_param is None

    @property
    def nproc(self) -> int:
        """Rank processes the case starts."""
        return self.spec.nproc if self.spec else 1

    @property
    def nnodes(self) -> int:
        """Nodes the case runs on."""
        return self.spec.nnodes if self.spec else 1


@dataclass
class SuiteInventory:
    """The outcome of :func:`build_inventory`.

    ``owners[nodeid]`` lists ``(suite, entry id)`` pairs; ``problems`` holds
    every rule violation found (empty: the inventory is clean).
    """

    root: Path
    manifests: dict[str, Manifest]
    cases: list[CollectedCase]
    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    #: Test files that yield no case: repository-relative file -> why (an import error, or a
    #: module-level skip; a folder whose conftest skips at module level is one too).
    unloadable: dict[str, str] = field(default_factory=dict)

    def suite_cases(self, suite: str) -> list[tuple[CollectedCase, Entry]]:
        """The cases ``suite`` owns, each with its owning entry, in collection order; then one
        case per :attr:`unloadable` file an entry of the suite names, whose node id is the
        file itself, so that a run reports that entry (failed, or skipped) and runs the rest."""
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
        """JSON form ``{"cases": [...], "errors": [...], "warnings": [...]}`` (warnings: the
        problems of ``harness.names.WARNING_RULES``, which do not fail the inventory),
        limited to ``suites`` when given."""
        wanted = set(suites) if suites is not None else None
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
            for c, entries in self._views(wanted)
        ]
        return {
            "cases": cases,
            "errors": [asdict(p) for p in self.problems if p.rule not in names.WARNING_RULES],
            "warnings": [asdict(p) for p in self.problems if p.rule in names.WARNING_RULES],
        }

    def _views(self, wanted: set[str] | None) -> list[tuple[CollectedCase, list[str]]]:
        """Each case as its owning entries run it (:func:`as_owned`), with those entries
        (``suite:id``): one row per distinct (device, cards), so a plain case of the cpu suite
        and of a cuda entry is listed twice; with ``wanted``, only rows of those suites."""
        out = []
        # The first entry of each id, as ownership records it.
        by_id = {(m.suite, e.id): e for m in self.manifests.values() for e in reversed(m.entries)}
        for c in self.cases:
            owners = self.owners.get(c.nodeid, [])
            if not owners:
                if wanted is None:
                    out.append((c, []))
                continue
            views: dict[tuple[str, int], tuple[CollectedCase, list[str]]] = {}
            for s, eid in owners:
                if wanted is not None and s not in wanted:
                    continue
                seen = as_owned(c, by_id[s, eid])
                views.setdefault((seen.device, seen.cards), (seen, []))[1].append(f"{s}:{eid}")
            out += views.values()
        return out


def as_owned(case: CollectedCase, entry: Entry) -> CollectedCase:
    """``case`` as ``entry`` runs it: a :attr:`~CollectedCase.plain` case of an accelerator
    entry is a case on that accelerator needing the entry's ``cards``; any other case keeps
    the device it says (its launch marker, its ``device`` parameter)."""
    if entry.accelerator is None or not case.plain:
        return case
    return replace(case, entry_device=entry.accelerator, entry_cards=entry.cards)


# --------------------------------------------------------------------------- collection

# A frame of a collection error's traceback: ``path:LINE: in ...`` (pytest's own
# form) or ``File "path", line LINE`` (a SyntaxError's).
_FRAME = re.compile(
    r'^(?:E\s+)?File "(?P<f1>[^"]+)", line (?P<l1>\d+)|^(?P<f2>[^\s<][^:\n]*):(?P<l2>\d+): in ',
    re.M,
)


def _collection_error(report: Any, root: Path) -> Problem:
    """A ``collection-error`` problem for a failed collect report: the file, its line
    on the stack and, when the error was raised further down in another file of
    the repository, that file and line; and the error's last line."""
    text = str(report.longrepr).strip()
    lines = text.splitlines()
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    message = errors[-1] if errors else (lines[-1] if lines else "collection failed")
    file = report.nodeid.split("::", 1)[0] or "."
    frames = []
    for m in _FRAME.finditer(text):
        path, line = (m["f1"], m["l1"]) if m["f1"] else (m["f2"], m["l2"])
        full = Path(path) if os.path.isabs(path) else root / path
        name = rel(full, root)
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


def _absent_module(
    file: str, message: str, root: Path, raised_in: Sequence[str] = ()
) -> str | None:
    """The top-level module whose absence kept test module ``file`` from importing, when
    nothing on the current ``sys.path`` (the collection's) provides it and no folder from
    the file's, or from that of the repository file that raised (``raised_in``), up to
    ``root`` holds a module or package of that name (the repository's own, imported the
    wrong way: an error no install mends); else None."""
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
    """``problems`` with the per-file ``missing-dependency`` problems of each absent module
    replaced, where the first stood, by one warning naming the module and every test file
    it keeps from loading."""
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
    """What one in-process collect-only pytest run saw (the plugin recording it): ``files``,
    the test files it collected by its own rules; ``scope``, the paths it collected from
    (its arguments, or ``testpaths``); ``inipath``, the configuration file it used."""

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
    #: pytest stopped the whole session (a usage or internal error): what it collected says
    #: nothing about which entries own cases.
    failed: bool = False
    interrupted: bool = False  # Ctrl-C
    exited: str = ""  # pytest.exit during collection: why

    def extend(self, other: Collection) -> None:
        """Add another run's findings (cases already seen are not repeated)."""
        seen = {c.nodeid for c in self.cases}
        self.cases += [c for c in other.cases if c.nodeid not in seen]
        self.problems += other.problems
        self.skipped.update(other.skipped)
        self.layout = self.layout or other.layout
        self.files = list(dict.fromkeys([*self.files, *other.files]))
        self.inipath = self.inipath or other.inipath
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
        # A folder named on the command line has its conftest loaded before the session, where
        # pytest lets a module-level skip escape as a traceback; that skip dropped, collection
        # loads the conftest again and reports the folder skipped, as when pytest reaches the
        # folder from above (harness run does the same: harness.suites.selection).
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
            is_test_module(report.nodeid) or _skipped_folder(report.nodeid, self.root)
        ):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            self.skipped[report.nodeid] = str(reason).removeprefix("Skipped: ")

    def pytest_collection_finish(self, session: Any) -> None:
        self.scope = [rel(Path(a.split("::", 1)[0]), self.root) for a in session.config.args]
        if not self.cases:  # (harness run's plan added them as it planned)
            self.add_items(session.items)

    def add_items(self, items: Iterable[Any]) -> None:
        """Record pytest's collected ``items`` as cases (a command case's item aside: its
        case comes from its manifest entry, :func:`command_case`)."""
        self.cases += [_case(i, self.root) for i in items if not hasattr(i, "harness_case_id")]


def is_test_module(nodeid: str) -> bool:
    """True when a collector's node id is a test module (a ``.py`` file, not a conftest)."""
    return "::" not in nodeid and nodeid.endswith(".py") and not nodeid.endswith("conftest.py")


def _skipped_folder(nodeid: str, root: Path) -> bool:
    """True when a skipped collector's node id is a folder below ``root`` (its
    ``conftest.py`` skips at module level): like a test module's skip, it is one skipped case."""
    return "::" not in nodeid and nodeid not in ("", ".") and (root / nodeid).is_dir()


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
    nodeid = case_id(item, root)
    try:
        spec, err = spec_for_item(item), None
    except (ValueError, TypeError) as e:
        spec, err = None, str(e)
    refusal = launch_refusal(item) if spec is not None and is_launched(item) else None
    if refusal is not None:  # the plugin refuses to run it: not a case of nproc ranks
        spec, err = None, refusal
    return CollectedCase(
        nodeid=nodeid,
        file=nodeid.split("::", 1)[0],
        spec=spec,
        launched=is_launched(item),
        device_param=param if isinstance(param, str) else None,
        marks=marks,
        spec_error=err,
    )


@contextlib.contextmanager
def _quiet_in(root: Path) -> Iterator[io.StringIO]:
    """Output captured, working directory at ``root`` (where pytest applies ``testpaths``)
    and ``root`` importable first, as ``python -m pytest`` started there makes it (the
    tests ``harness run`` then runs import alike, wherever it was started)."""
    buf = io.StringIO()
    here = os.getcwd()
    os.chdir(root)
    added = str(root) not in sys.path
    if added:
        sys.path.insert(0, str(root))
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield buf
    finally:
        os.chdir(here)
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(str(root))


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
    """``-p`` arguments that load :data:`NEEDED_PLUGINS` when plugin autoloading is disabled
    (none otherwise: autoloading finds them), by entry-point name where a distribution
    declares one (as pytest then loads it, setting up what autoloading would), else by
    module name; plugins not installed are left out."""
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
    # No test code runs here, so nothing can raise an unraisable exception; that
    # plugin's forced garbage collections at exit cost seconds on a large tree.
    # This process imported the harness before pytest could mark it for assertion
    # rewriting; a project's `filterwarnings = error` must not turn that notice into a failure.
    args = [
        *("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception"),
        *("--continue-on-collection-errors", f"--rootdir={root}", *plugin_args()),
        *("-W", "ignore::pytest.PytestAssertRewriteWarning"),
        *(str(root / t) for t in targets or ()),
    ]
    # The caller's PYTEST_ADDOPTS is for running tests (a --junitxml there
    # would be overwritten by an empty collect-only report): not for this.
    addopts = os.environ.pop("PYTEST_ADDOPTS", None)
    # Collection allocates a node graph that lives until the end: the cyclic
    # collector would walk it again and again (half the time on 10,000 cases).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _quiet_in(root) as out:
            try:
                code = pytest.main(args, plugins=[rec])
            except Exception as exc:  # before its session: a config warning made an error
                print(f"{type(exc).__name__}: {exc}", file=out)
                code = pytest.ExitCode.INTERNAL_ERROR
            except SystemExit as exc:  # sys.exit() in a conftest pytest loads before its session
                print(f"SystemExit({exc.code!r}) while pytest loaded the project", file=out)
                code = pytest.ExitCode.INTERNAL_ERROR
    finally:
        if gc_was_enabled:
            gc.enable()
        if addopts is not None:
            os.environ["PYTEST_ADDOPTS"] = addopts
    if rec.interrupted:
        raise KeyboardInterrupt  # pytest reported it and returned; the caller asked to stop
    # 0: collected, 1: some collection error (recorded above), 5: nothing collected.
    rec.failed = bool(rec.exited) or int(code) not in (0, 1, 5)
    if rec.exited:
        why = f"pytest.exit during collection ({rec.exited})"
    else:
        why = f"pytest exited with {int(code)}:\n" + "\n".join(
            out.getvalue().strip().splitlines()[-15:]
        )
    if rec.failed:
        rec.problems.append(Problem(names.COLLECTION_ERROR, ".", "", why))
    return rec


def _under(path: str, roots: set[str]) -> bool:
    """True when ``path`` is one of ``roots`` or lies under one (``.`` is everything)."""
    if "." in roots or path in roots:
        return True
    parts = path.split("/")
    return any("/".join(parts[:k]) in roots for k in range(1, len(parts)))


def _glob_all(root: Path, patterns: Iterable[str]) -> set[str]:
    """The ``.py`` files and directories under ``root`` that any of ``patterns`` matches (as
    entries match), hidden ones aside: one walk of each literal top directory serves every
    pattern, each path tried only on the globs that can match it (:class:`EntryIndex`);
    nothing below a match is looked at."""
    patterns = tuple(patterns)
    index = EntryIndex([Entry("", patterns, None, None, 0.0, None, "", "")])
    tops = {
        "/".join(itertools.takewhile(lambda s: not has_glob(s), p.split("/"))) or "."
        for p in patterns
    }
    walked: set[str] = set()
    found: set[str] = set()
    for top in sorted(tops, key=lambda p: (p.count("/"), p)):
        if _under(top, walked):
            continue  # walked from a directory above
        walked.add(top)
        for dirpath, dirnames, filenames in os.walk(root / top):
            base = rel(Path(dirpath), root)
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files = [f for f in filenames if f.endswith(".py") and not f.startswith(".")]
            hits = {
                n
                for n in [*dirnames, *files]
                if index.covers_file(f"{base}/{n}".removeprefix("./"))
            }
            found.update(f"{base}/{n}".removeprefix("./") for n in hits)
            dirnames[:] = [d for d in dirnames if d not in hits]
    return found


def entry_targets(
    root: Path, manifests: Iterable[Manifest], *, skip: set[str] | None = None
) -> list[str]:
    """Minimal collection arguments covering every entry path of ``manifests`` but those in
    ``skip`` (each glob expanded once, covered paths dropped in one pass)."""
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
    paths.update(_glob_all(root, patterns))
    paths -= skip or set()
    kept: set[str] = set()
    for p in sorted(paths, key=lambda p: (p.count("/"), p)):
        if not _under(p, kept):
            kept.add(p)
    return sorted(kept)


# --------------------------------------------------------------------------- matching


class _Markers:
    """A case's markers as pytest's ``-m`` language evaluates them."""

    def __init__(self, case: CollectedCase):
        self.by_name: dict[str, list[dict[str, Any]]] = {}
        for name, kwargs in case.marks:
            self.by_name.setdefault(name, []).append(dict(kwargs))

    def __call__(self, name: str, /, **kwargs: Any) -> bool:
        return any(
            all(m.get(k, object()) == v for k, v in kwargs.items())
            for m in self.by_name.get(name, ())
        )


def _literal_segment(pattern: str) -> str | None:
    """The last path segment of a glob without glob syntax (``None`` when every segment has some).

    A path the glob matches (or lies under a directory it matches) has this
    segment among its own, so the glob need only be tried on such paths.
    """
    literal = [part for part in pattern.split("/") if not has_glob(part)]
    return literal[-1] if literal else None


def _ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, ``.`` included: ``a/b/c`` -> ``., a, a/b, a/b/c``."""
    parts = path.split("/")
    return [".", *("/".join(parts[:k]) for k in range(1, len(parts) + 1))]


def _id_prefixes(nodeid: str) -> list[str]:
    """Every prefix of a node id that a node-id selector may name: the id itself and
    the id cut before each ``::`` and each ``[``."""
    cuts = {i for i in range(1, len(nodeid)) if nodeid.startswith("::", i) or nodeid[i] == "["}
    return [nodeid, *(nodeid[:i] for i in sorted(cuts))]


class EntryIndex:
    """The entries of one manifest, indexed so that finding the entries that select
    a case costs time in the case's path depth and the few candidates, not in the
    number of entries: node-id selectors and plain paths are looked up by the
    case's id prefixes and ancestor directories, globs are compiled once and
    tried only on paths holding their last literal segment."""

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
                    self.by_path.setdefault(sel.rstrip("/") or ".", []).append(i)
            if e.markers is not None:
                self.markers[i] = marker_expression(e.markers)

    def _selecting(self, case: CollectedCase) -> dict[int, bool]:
        """Entry position -> whether it names the case by node id, for every entry a selector of which matches."""
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
        """The globs that can match ``path`` or a directory above it (see :func:`_literal_segment`)."""
        yield from self.globs.get(None, ())
        for segment in set(path.split("/")):
            yield from self.globs.get(segment, ())

    def covers_file(self, path: str, *, node_ids: bool = True) -> bool:
        """True when some entry's path (a node id's file part included, unless not
        ``node_ids``: then only entries that hold the whole file) is ``path`` or a
        directory above it."""
        dirs = _ancestors(path)
        if any(d in self.by_path or (node_ids and d in self.id_files) for d in dirs):
            return True
        return any(rx.match(a) for rx, _ in self._globs_for(path) for a in dirs[1:])

    def names_id(self, nodeid: str) -> bool:
        """True when some entry's node-id selector names ``nodeid`` (or a prefix of it)."""
        return any(p in self.by_id for p in _id_prefixes(nodeid))

    def matching(self, case: CollectedCase, suite_device: str) -> list[Entry]:
        """The entries (in manifest order) that select ``case`` in a suite on ``suite_device``."""
        out = []
        marks: _Markers | None = None
        for i, by_id in sorted(self._selecting(case).items()):
            # Another device's variant of a shared test is that device's suite's case.
            if not by_id and as_owned(case, self.entries[i]).device != suite_device:
                continue
            if i in self.markers:
                marks = marks or _Markers(case)
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


# --------------------------------------------------------------------------- building


@dataclass
class _Scope:
    """Which manifests an inventory reads (all of them) and judges (the selected ones);
    ``manifests_ok``: every manifest loaded (else ownership is noise)."""

    all: list[Manifest]
    selected: list[Manifest]
    problems: list[Problem]
    manifests_ok: bool


def _load_scope(root: Path, suites: Iterable[str] | None) -> _Scope:
    """Phase 1: load every manifest, keep the problems of the selected suites."""
    manifests, problems = load_suites(root)
    if not manifests and not problems:
        # Never "0 case(s), 0 problem(s)": a repository without suites checks nothing.
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
    on the entry's device (else the suite's) with its ``cards`` (default: one on an
    accelerator), counted as one process per card (one on cpu), as a ``torchrun`` with a
    rank per card runs."""
    assert entry.command is not None
    device = entry.device or m.device
    spec = LaunchSpec(device, 1 if device == "cpu" else entry.cards)
    nodeid = f"{m.suite}::{entry.id}"
    return CollectedCase(nodeid, entry.source, spec, False, None, command=entry.command)


def _assign_owners(inv: SuiteInventory, m: Manifest, judged: bool, idle: bool = True) -> None:
    """Phase 4, one suite: record the first matching entry of ``m`` for each case, and the
    case of each command entry; when the suite is ``judged``, add their fit problems and,
    with ``idle`` (the collection saw the whole suite), ``entry-matches-nothing``."""
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
    # An entry naming a file that fails to import or skips as a whole is not idle: a run
    # reports it (failed or skipped) through that file.
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
    return Problem(
        names.ENTRY_MATCHES_NOTHING,
        e.source,
        f"{where} (entry {e.id!r})",
        f"suite {m.suite!r}: {why}",
        m.suite,
    )


def _covers_unloadable(inv: SuiteInventory, entry: Entry) -> bool:
    """Whether ``entry`` names a test file that failed to import or skips as a whole."""
    return any(EntryIndex([entry]).covers_file(f) for f in inv.unloadable)


def _dead_paths(inv: SuiteInventory, m: Manifest, owned_by: dict[str, int]) -> list[Problem]:
    """``entry-matches-nothing`` for each path of an entry owning cases through its other
    paths when that path selects no collected case (of any device) and no file that failed
    to load: a misspelled file, glob or node id there would otherwise go unnoticed."""
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
    """Phase 5: ``unowned-file`` for each test file pytest collects by default none of
    whose cases any suite owns, ``unowned-case`` for each other case no suite owns."""
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
    out = [
        Problem(
            names.UNOWNED_FILE,
            f,
            "",
            "test file owned by no suite entry: add it to a suite in suites/",
        )
        for f in unowned_files
    ]
    for c in inv.cases:
        if c.spec is None or c.nodeid in inv.owners or c.file in unowned_files:
            continue
        mine = [m.path for m in manifests if m.device == c.device]
        hint = (
            f"add its file or node id to an entry of {' or '.join(mine)}"
            if mine
            else f"no suite runs {c.device} cases: add one (`harness init --accelerators {c.device}`)"
        )
        out.append(
            Problem(
                names.UNOWNED_CASE,
                c.file,
                c.nodeid,
                f"{c.device} case owned by no suite entry: {hint}",
            )
        )
    return out


def _hidden_problems(
    root: Path, layout: dict[str, list[str]], collected: Iterable[str]
) -> list[Problem]:
    """A ``tests-under-norecursedirs`` warning for each test file (``python_files``) under a
    directory inside ``testpaths`` that a ``norecursedirs`` pattern keeps pytest out of,
    and that was not collected (no entry names it): it never runs. Hidden directories
    (``.*``) and virtual environments are not looked into."""
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
    seen = set(collected)
    why = (
        "lies under a directory that norecursedirs pattern {!r} hides from pytest inside "
        "testpaths: it never runs; name it in a suite entry (harness run collects entry "
        "paths by name) or change norecursedirs"
    )
    return [
        Problem(names.HIDDEN_TESTS, f, "", why.format(pat))
        for f, pat in sorted(hidden.items())
        if f not in seen
    ]


def _outside_problems(root: Path, files: Iterable[str]) -> list[Problem]:
    """``symlink-outside-repository`` for each collected test file whose real location
    (through a symlink) is outside the repository, as manifests reject such paths."""
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
    """Collect the repository's tests and check them against its suites.

    ``suites`` limits the checked suites (default: all of ``suites/*.json``). With
    ``check_ownership`` (default) pytest collects what it collects by default (its
    ``testpaths``, ``python_files``, ``norecursedirs``, ``--ignore``), plus entry paths
    outside that, and every test file it finds must be owned by *some* suite (ownership
    is global: a file the cpu suite owns is owned when only gpu is inventoried). Without
    it only the selected suites' entry paths are collected (what ``harness run`` needs).
    A repository without suites is a ``no-suites`` problem.
    """
    root = root.resolve()
    scope = _load_scope(root, suites)
    if any(p.rule == names.NO_SUITES for p in scope.problems):
        # Nothing to hold cases against; outside a repository a collection would import
        # every test file below the working directory first.
        return SuiteInventory(root=root, manifests={}, cases=[], problems=scope.problems)
    if not check_ownership:
        found = collect(root, entry_targets(root, scope.selected))
        return _judge(root, scope, found, check_ownership=False)
    found = collect(root, None)
    # An entry may name what pytest does not collect by default (outside testpaths,
    # under norecursedirs): collect those paths by name, as `harness run` does. Paths
    # under a collected file's folders are skipped first, so that an entry naming
    # tests/dist (hidden by norecursedirs) under another's tests is collected too.
    seen = {a for f in found.files for a in _ancestors(f)}
    extra = entry_targets(root, scope.all, skip=seen)
    if extra:
        found.extend(collect(root, extra))
    return _judge(root, scope, found, check_ownership=True)


def run_inventory(
    root: Path, manifest: Manifest, found: Collection, *, whole: bool
) -> SuiteInventory:
    """The inventory of one suite (``manifest``) from a collection made elsewhere: the
    items ``harness run``'s own pytest session collected (``harness.suites.selection``),
    recorded in ``found``. Its rules are :func:`build_inventory`'s without ownership;
    ``entry-matches-nothing`` is judged only where the collection saw the ``whole`` suite
    (no paths given to pytest)."""
    scope = _Scope([manifest], [manifest], [], True)
    return _judge(root, scope, found, check_ownership=False, idle=whole)


def load_suite_manifest(root: Path, suite: str) -> tuple[Manifest | None, list[Problem]]:
    """The manifest of ``suite`` (a name or a manifest path) and the blocking problems
    found loading it (``no-suites``, ``unknown-suite``, schema, duplicate ids, an expired
    quarantine): what keeps ``harness run`` from starting before anything is collected."""
    scope = _load_scope(root.resolve(), [suite])
    name = suite_name(suite)
    problems = [
        p for p in scope.problems if p.suite in (name, None) and p.rule in names.BLOCKING_RULES
    ]
    return next((m for m in scope.selected if m.suite == name), None), problems


def blocking_problems(inv: SuiteInventory, suite: str) -> list[Problem]:
    """The problems of ``inv`` that keep ``harness run`` / ``matrix`` from planning
    ``suite``: rules of ``BLOCKING_RULES`` of that suite or of none, save a test file that
    fails to import (a run reports it as its entry's failure; a conftest, or pytest itself,
    failing spoils every case)."""
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
    """Phases 3 to 5 of :func:`build_inventory`: what ``found`` collected, held against
    the manifests of ``scope``."""
    unloadable = {
        p.file: p.message
        for p in found.problems
        if p.rule in (names.COLLECTION_ERROR, names.MISSING_DEPENDENCY) and is_test_module(p.file)
    }
    spec_problems = [
        Problem(names.BAD_LAUNCH_SPEC, c.file, c.nodeid, c.spec_error or "invalid launch marker")
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
    # After a session-wide failure (its one collection-error names it), every entry would
    # "match nothing" and every file be "unowned": noise hiding the cause.
    judged = set() if found.failed else {m.suite for m in scope.selected}
    for m in scope.all if check_ownership else scope.selected:
        _assign_owners(inv, m, m.suite in judged, idle)
    if check_ownership and scope.manifests_ok and not found.failed:
        inv.problems.extend(_ownership_problems(inv, scope.all, found.files))
        inv.problems.extend(_hidden_problems(root, found.layout, found.files))
    return inv
