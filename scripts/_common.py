"""Helpers shared by the repository's scripts and its noxfile (one home for each).

Importable as ``scripts._common`` from the repository root, and runnable as a script for the
shell scripts: ``python scripts/_common.py outer-site-pth SITE_PACKAGES`` writes the
:data:`OUTER_PTH` file described at :func:`write_outer_site_pth` into ``SITE_PACKAGES``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

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
    path.write_text("".join(f"{d}\n" for d in outer_site_dirs()), encoding="utf-8")
    return path


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
    args = parser.parse_args(argv)
    try:
        print(write_outer_site_pth(args.site_packages))
    except OSError as err:
        parser.exit(2, f"{parser.prog}: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
