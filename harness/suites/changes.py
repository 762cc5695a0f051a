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

#: The default of a manifest's ``run_everything_on``: files that decide what and how every
#: case runs (suites, build and pytest configuration, conftest, CI, dependency pins).
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
    """Which entries to run, whether the change (or not knowing it) forced ``everything``, and
    why (``reason``, one line for the log)."""

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


def changed_files(root: Path, ref: str) -> tuple[list[str] | None, str]:
    """The files that differ between the merge base of ``ref`` and ``HEAD`` and the working
    tree (committed, staged, unstaged, untracked; a rename as both names), as paths from
    ``root`` (``../x`` outside it, in a monorepo), and ``""``; or ``None`` and why git cannot
    tell (an unknown ref, no merge base, not a repository, no git)."""
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
    here = root.resolve().relative_to(top).as_posix()  # git found top from root: it holds it
    names = {name for name in (diff + untracked).split("\0") if name}
    return sorted(posixpath.relpath(name, here) for name in names), ""


def select(
    entries: Sequence[Entry],
    changed: Iterable[str] | None,
    unknown: str = "",
    *,
    run_everything_on: Sequence[str] | None = None,
) -> ChangeSelection:
    """The entries a change makes run: every entry when ``changed`` is ``None`` (unknown, for
    the reason ``unknown``), or a changed file matches ``run_everything_on`` (``None``:
    :data:`RUN_EVERYTHING`) or lies outside the root (a test may read it); else each entry
    whose ``depends_on`` globs or own paths match a changed file, and each without them."""
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
