"""nox sessions. Every session reuses this interpreter's torch (accelerator images ship their own)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "inventory", "tests"]

VENV_PARAMS = ["--system-site-packages"]


# The optional extras (`hf`, `plot`) whose tests skip without them; test runs install them
# so those tests run. None of them depends on torch, so the interpreter's torch stays.
OPTIONAL_TEST_DEPS = ["transformers>=4.46", "accelerate>=0.26", "matplotlib>=3.7"]


def _install(session: nox.Session, *, optional: bool = False) -> None:
    # --no-deps for the project itself keeps pip from replacing the interpreter's torch.
    session.install("--no-deps", "-e", ".")
    session.install("pytest", "pytest-xdist", "hypothesis", "jsonschema", "pyyaml",
                    "filelock", "psutil", "numpy")
    if optional:
        session.install(*OPTIONAL_TEST_DEPS)


@nox.session(venv_params=VENV_PARAMS)
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    _install(session, optional=True)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """ruff check (the rules in pyproject.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(venv_params=VENV_PARAMS)
def inventory(session: nox.Session) -> None:
    """Check that every test is owned by a suite and fits its runner (`harness inventory`)."""
    _install(session)
    session.run("python", "-m", "harness", "inventory", *session.posargs)


def _suite(session: nox.Session, suite: str) -> None:
    # posargs go to `harness run`: `nox -s suite-gpu -- --shard 1/2 -- -x`.
    _install(session, optional=True)
    session.run("python", "-m", "harness", "run", suite, *session.posargs)


@nox.session(name="suite-cpu", venv_params=VENV_PARAMS)
def suite_cpu(session: nox.Session) -> None:
    """Run the CPU suite (suites/cpu.json) through the harness."""
    _suite(session, "cpu")


@nox.session(name="suite-gpu", venv_params=VENV_PARAMS)
def suite_gpu(session: nox.Session) -> None:
    """Run the CUDA suite (suites/gpu.json); fails where no CUDA card is visible."""
    _suite(session, "gpu")


@nox.session(name="suite-npu", venv_params=VENV_PARAMS)
def suite_npu(session: nox.Session) -> None:
    """Run the Ascend NPU suite (suites/npu.json); fails where no NPU is visible."""
    _suite(session, "npu")


@nox.session(venv_params=VENV_PARAMS)
def bench(session: nox.Session) -> None:
    """The chunked-loss benchmark (posargs replace the default sizes)."""
    _install(session)
    session.run("python", "scripts/bench/chunk_loss.py", *(session.posargs or ["--tokens", "1024", "--vocab", "8000"]))


@nox.session(venv_params=VENV_PARAMS)
def demo(session: nox.Session) -> None:
    """The per-source loss training demo; posargs go to `python -m channel_loss.demo` (`nox -s demo -- --sp 2`)."""
    _install(session)
    session.install("matplotlib")  # the `plot` extra: the demo writes channel_loss.png with it
    session.run("python", "-m", "channel_loss.demo", *session.posargs)
