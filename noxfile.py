"""nox sessions. Every session reuses the torch of the interpreter nox runs on (accelerator
images ship their own), whether that is the system interpreter or a virtualenv.

Session venvs are created without ``--system-site-packages`` (that would inherit the *base*
interpreter's site-packages, not those of a virtualenv nox runs from); instead each session
venv gets a ``.pth`` file listing nox's own site-packages directories. They come after the
venv's own, so what a session installs wins and everything else (torch above all) is found
where nox's interpreter has it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "inventory", "tests"]

#: The file every session venv gets (see the module docstring).
OUTER_PTH = "_nox_outer_site.pth"

# Test-time dependencies of this repository besides the two distributions (the `test` extra
# minus the tools that sessions of their own install). None of them depends on torch.
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "numpy", "pyyaml>=6"]
# The optional extras (`hf`, `plot`) whose tests skip without them; test runs install them
# so those tests run.
OPTIONAL_TEST_DEPS = ["transformers>=4.46", "accelerate>=0.26", "matplotlib>=3.7"]

def outer_site_dirs() -> list[str]:
    """The site-packages directories of the interpreter running nox, in its own order."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def reuse_outer_site(session: nox.Session) -> None:
    """Make nox's own packages (torch) importable in the session venv, after the venv's own."""
    if not isinstance(session.virtualenv, nox.virtualenv.VirtualEnv):
        return  # venv_backend none / passthrough: the session already runs in nox's environment
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    site = Path(str(purelib).strip().splitlines()[-1])
    site.joinpath(OUTER_PTH).write_text("".join(f"{d}\n" for d in outer_site_dirs()), encoding="utf-8")


def _install(session: nox.Session, *, optional: bool = False) -> None:
    reuse_outer_site(session)
    # --no-deps for the two distributions keeps pip from replacing the interpreter's torch;
    # their other run-time dependencies are listed here instead.
    session.install("--no-deps", "-e", "./harness", "-e", ".")
    session.install(*TEST_DEPS, "jsonschema>=4.18", "psutil>=5.9")
    if optional:
        session.install(*OPTIONAL_TEST_DEPS)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    _install(session, optional=True)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (the rules in pyproject.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def inventory(session: nox.Session) -> None:
    """Check that every test is owned by a suite and fits its runner (`harness inventory`)."""
    _install(session)
    session.run("python", "-m", "harness", "inventory", *session.posargs)


def _suite(session: nox.Session, suite: str) -> None:
    # posargs go to `harness run`: `nox -s suite-gpu -- --shard 1/2 -- -x`.
    _install(session, optional=True)
    session.run("python", "-m", "harness", "run", suite, *session.posargs)


def _suite_names() -> list[str]:
    # One session per manifest: suites/<name>.json -> suite-<name>.
    return sorted(p.stem for p in (Path(__file__).parent / "suites").glob("*.json") if p.stem != "schema")


for _name in _suite_names():

    def _session(session: nox.Session, _suite_name: str = _name) -> None:
        _suite(session, _suite_name)

    _session.__doc__ = f"Run suites/{_name}.json through the harness (`harness run {_name}`)."
    nox.session(name=f"suite-{_name}")(_session)


@nox.session
def durations(session: nox.Session) -> None:
    """Refresh suites/durations/ from CI artifacts: `nox -s durations -- ARTIFACT_DIR ... [--prune]`.

    The folders hold the downloaded `harness-*` artifacts of a push run (each `harness run`
    output: plan.json and JUnit XML); see scripts/refresh_durations.py.
    """
    if not session.posargs:
        session.error("give the folders of the downloaded CI artifacts: nox -s durations -- DIR ...")
    _install(session)
    session.run("python", "scripts/refresh_durations.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The chunked-loss benchmark (posargs replace the default sizes)."""
    _install(session)
    session.run("python", "scripts/bench/chunk_loss.py", *(session.posargs or ["--tokens", "1024", "--vocab", "8000"]))


@nox.session
def demo(session: nox.Session) -> None:
    """The per-source loss training demo; posargs go to `python -m channel_loss.demo` (`nox -s demo -- --sp 2`)."""
    _install(session)
    session.install("matplotlib")  # the `plot` extra: the demo writes channel_loss.png with it
    session.run("python", "-m", "channel_loss.demo", *session.posargs)
