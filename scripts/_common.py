"""Helpers shared by the repository's scripts and its noxfile (one home for each).

Importable as ``scripts._common`` from the repository root, and runnable as a script for the
shell scripts (any Python >= 3.10 with pip, nothing else installed):

- ``python scripts/_common.py outer-site-pth SITE_PACKAGES`` writes the :data:`OUTER_PTH`
  file described at :func:`write_outer_site_pth` into ``SITE_PACKAGES``;
- ``python scripts/_common.py build-ready PYPROJECT...`` exits 0 when this interpreter meets
  every build-system requirement of those files (:func:`unmet_build_requirements`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds `harness`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.jsonio import write_text

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an interpreter with pip only (a card machine's image)
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

#: This repository's root, and the pyproject files of its two distributions.
REPO = Path(__file__).resolve().parents[1]
PYPROJECTS = ("pyproject.toml", "harness/pyproject.toml")

#: The ``.pth`` file that makes an outer interpreter's packages visible in a virtualenv.
OUTER_PTH = "_outer_site.pth"


def outer_site_dirs() -> list[str]:
    """The site-packages directories of the running interpreter, in its own import order.

    For an interpreter inside a virtualenv these are the virtualenv's own (and, when it was
    made with ``--system-site-packages``, the base interpreter's after them): what
    ``import`` finds in this interpreter, unlike ``venv --system-site-packages``, which
    always reaches the *base* interpreter whatever virtualenv the command runs from.
    """
    return [
        p
        for p in sys.path
        if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()
    ]


def write_outer_site_pth(site_packages: Path) -> Path:
    """Write :data:`OUTER_PTH` into another environment's ``site_packages``, listing
    :func:`outer_site_dirs`, and return its path.

    ``site`` appends those directories to that environment's ``sys.path`` after its own
    site-packages: what it installs itself wins, and everything else (torch above all) is
    imported from where this interpreter has it. Such a directory's own ``.pth`` files are
    not processed, so another environment's editable installs do not leak in.
    """
    site_packages = Path(site_packages)
    if not site_packages.is_dir():
        raise NotADirectoryError(f"{site_packages}: not a site-packages directory")
    path = site_packages / OUTER_PTH
    write_text(path, "".join(f"{d}\n" for d in outer_site_dirs()))
    return path


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def requirements(
    root: Path = REPO,
    extras: Iterable[str] = (),
    *,
    optional: bool = True,
    build_system: bool = False,
    exclude: Iterable[str] = (),
) -> list[str]:
    """The requirements of this repository's distributions (:data:`PYPROJECTS` under
    ``root``), in file order and without repeats.

    Their run-time ``dependencies``; the root project's optional-dependency groups
    ``extras``, whose self-references (``channel-loss[hf,plot]``) are expanded when
    ``optional`` and left out otherwise; with ``build_system``, the files'
    ``build-system.requires`` too. Requirements naming a package in ``exclude`` (names
    compared canonically) are left out.
    """
    docs = [_project(root / p) for p in PYPROJECTS if (root / p).is_file()]
    if not docs:
        raise FileNotFoundError(f"{root}: no {' or '.join(PYPROJECTS)}")
    first = docs[0]["project"]
    own = canonicalize_name(first["name"])
    groups = first.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(groups))
    if unknown:
        raise KeyError(
            f"{root / PYPROJECTS[0]}: no optional-dependencies group {', '.join(unknown)}"
        )
    skip = {canonicalize_name(n) for n in exclude}
    pending = [r for d in docs for r in d["project"].get("dependencies", [])]
    pending += [r for extra in extras for r in groups[extra]]
    if build_system:
        pending += [r for d in docs for r in d.get("build-system", {}).get("requires", [])]
    out: list[str] = []
    while pending:
        text = pending.pop(0)
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == own:
            if optional:
                pending += [r for extra in sorted(req.extras) for r in groups[extra]]
        elif name not in skip and text not in out:
            out.append(text)
    return out


def unmet_build_requirements(pyprojects: Iterable[Path]) -> list[str]:
    """The ``build-system.requires`` of ``pyprojects`` (missing files skipped) that this
    interpreter's installed distributions do not satisfy."""
    unmet = []
    for path in map(Path, pyprojects):
        if not path.is_file():
            continue
        for text in _project(path).get("build-system", {}).get("requires", []):
            req = Requirement(text)
            try:
                ok = req.specifier.contains(version(req.name), prereleases=True)
            except PackageNotFoundError:
                ok = False
            if not ok:
                unmet.append(text)
    return unmet


def main(argv: Sequence[str] | None = None) -> int:
    """Command line for the shell scripts; see the module docstring."""
    parser = argparse.ArgumentParser(prog="scripts/_common.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pth = sub.add_parser(
        "outer-site-pth", help="make this interpreter's packages visible in a venv"
    )
    pth.add_argument(
        "site_packages", type=Path, help="the venv's site-packages (its sysconfig purelib)"
    )
    build = sub.add_parser(
        "build-ready", help="exit 0 when this interpreter can build the projects itself"
    )
    build.add_argument("pyprojects", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build-ready":
        unmet = unmet_build_requirements(args.pyprojects)
        for text in unmet:
            print(f"build: {text} is not installed; isolated build with the wheel folder's")
        if not unmet:
            print("build: the interpreter's setuptools (--no-build-isolation)")
        return 1 if unmet else 0
    try:
        print(write_outer_site_pth(args.site_packages))
    except OSError as err:
        parser.exit(2, f"{parser.prog}: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
