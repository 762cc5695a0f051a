"""nox sessions. Every session reuses this interpreter's torch (accelerator images ship their own)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

VENV_PARAMS = ["--system-site-packages"]


def _install(session: nox.Session) -> None:
    # --no-deps for the project itself keeps pip from replacing the interpreter's torch.
    session.install("--no-deps", "-e", ".")
    session.install("pytest", "pytest-xdist", "hypothesis", "jsonschema", "pyyaml",
                    "filelock", "psutil", "numpy")


@nox.session(venv_params=VENV_PARAMS)
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
