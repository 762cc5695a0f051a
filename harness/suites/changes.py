"""Change-based selection for ``--changed-from REF`` (``harness run``, ``harness matrix``):
the entries a change since REF's merge base affects, never narrowing unsafely (:func:`select`
says the rules).
"""

from __future__ import annotations

import posixpath
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.suites.manifest import Entry, path_matches

#: The default of a manifest's ``run_everything_on``: a change to any of these runs
#: everything, for they decide what and how every case runs: the suites, the build and every
#: file pytest may read its configuration from, any ``conftest.py``, the noxfile, CI
#: workflows, dependency lockfiles and requirement lists.
RUN_EVERYTHING: tuple[str, ...] = (
    "suites",
    "pyproject.toml",
    "setup.py",
    "setup.cfg",
    "pytest.ini",
    ".pytest.ini",
    "pytest.toml",
    ".pytest.toml",
    "tox.ini",
    "noxfile.py",
    "**/conftest.py",
    ".github/workflows",
    "uv.lock",
    "poetry.lock",
    "pdm.lock",
    "Pipfile",
    "Pipfile.lock",
    "pixi.lock",
    "conda-lock.yml",
    "**/requirements*.txt",
    "**/requirements*.in",
    "**/constraints*.txt",
    "environment.yml",
    "environment.yaml",
)


@dataclass(frozen=True)
class ChangeSelection:
    """Which entries to run and why (``reason`` is one line for the log).

    ``everything`` is True when the change (or not knowing it) forced every entry to run.
    """

    entries: frozenset[str]
    everything: bool
    reason: str


def run_git(root: Path, *args: str) -> tuple[str | None, str]:
    """``git -C root ARGS``: its output and ``""``, or ``None`` and why it failed (its first
    line of error)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            errors="surrogateescape",  # a file name that is not UTF-8 is still a name
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"git {args[0]}: {e}"
    if done.returncode == 0:
        return done.stdout, ""
    error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
    return None, f"git {args[0]}: {error}"


def in_git_folder(root: Path) -> Path | None:
    """The top of the git repository whose folder (not its top) ``root`` is, found without
    git (a ``.git`` entry in a folder above); None at a repository's top or outside one."""
    here = root.resolve()
    if (here / ".git").exists():
        return None
    return next((d for d in here.parents if (d / ".git").exists()), None)


def changed_files(root: Path, ref: str) -> tuple[list[str] | None, str]:
    """The files that differ between the merge base of ``ref`` and ``HEAD`` and the working
    tree (committed, staged, unstaged and untracked changes; renames count as both names;
    a submodule as its folder), as paths from ``root``, and ``""``; or ``None`` and why git
    cannot tell (an unknown ref, no merge base, not a repository, no git).

    The harness's root may be a folder of the git repository (a monorepo's project): a
    change outside it is given as a path from the root (``../libs/x.py``), and runs every
    entry (:func:`select`): a test may read anything in the repository."""
    out, why = run_git(root, "rev-parse", "--show-toplevel")
    if not out or not out.strip():
        return None, why or f"git rev-parse: no top folder for {root}"
    top = Path(out.strip()).resolve()
    outer, _ = run_git(top, "rev-parse", "--show-superproject-working-tree")
    if outer and outer.strip():
        # What changed in the superproject around it (a library beside it) is not seen here.
        return None, f"{top} is a submodule of {outer.strip()}, whose changes it cannot see"
    base, why = run_git(top, "merge-base", ref, "HEAD")
    if base is None:
        if why.endswith("exit status 1"):  # git found both and no common ancestor
            why = f"no merge base of {ref} and HEAD (a shallow clone lacks it: fetch more)"
        return None, why
    # -z: names as they are (git quotes a name with non-ASCII bytes otherwise).
    diff, why = run_git(top, "diff", "--name-only", "-z", "--no-renames", base.strip())
    if diff is None:
        return None, why
    untracked, why = run_git(top, "ls-files", "-z", "--others", "--exclude-standard")
    if untracked is None:
        return None, why
    try:
        here = root.resolve().relative_to(top).as_posix()
    except ValueError:
        return None, f"{root} is not inside its git repository's top {top}"
    names = {name for name in (diff + untracked).split("\0") if name}
    if here == ".":
        return sorted(names), ""
    return sorted(posixpath.relpath(name, here) for name in names), ""


def select(
    entries: Sequence[Entry],
    changed: Iterable[str] | None,
    unknown: str = "",
    *,
    run_everything_on: Sequence[str] | None = None,
) -> ChangeSelection:
    """The entries a change makes run: every entry when ``changed`` is ``None`` (the changed
    files are unknown; ``unknown`` says why), when a changed file matches a glob of
    ``run_everything_on`` (a manifest's; ``None``: :data:`RUN_EVERYTHING`) or lies outside
    the harness's root (a monorepo's other folders: a test may read them); else each entry
    whose ``depends_on`` globs or own test paths match a changed file, and each entry
    without ``depends_on``."""
    everything_on = RUN_EVERYTHING if run_everything_on is None else run_everything_on
    all_ids = frozenset(e.id for e in entries)
    if changed is None:
        why = f" ({unknown})" if unknown else ""
        return ChangeSelection(all_ids, True, f"changed files unknown{why}: running every entry")
    changed = list(changed)
    for f in changed:
        if f == ".." or f.startswith("../") or any(path_matches(f, p) for p in everything_on):
            shown = f if f.isprintable() else repr(f)
            return ChangeSelection(all_ids, True, f"{shown} changed: running every entry")
    chosen = {
        e.id
        for e in entries
        if e.depends_on is None
        or any(
            path_matches(f, g)
            for f in changed
            for g in (*e.depends_on, *(p.split("::", 1)[0] for p in e.paths))
        )
    }
    reason = f"{len(changed)} changed file(s) select {len(chosen)} of {len(all_ids)} entries"
    return ChangeSelection(frozenset(chosen), False, reason if changed else "no file changed")
