"""Adopting the harness in another repository, as a new user would.

One fresh virtualenv per test session, without system site-packages, made from an
interpreter that has no torch of its own where this machine has one (so nothing leaks in
from the interpreter this suite runs on), gets CPU torch (the version running here, from
the local wheel) and the harness wheel built from ./harness: no channel-loss, no test
dependencies of this repository. In it:

- a new project with one plain test and one launched all-reduce test goes
  `harness init` -> `harness inventory` -> `harness run cpu`, green;
- a third-party project's own test suite (toolz, its sdist downloaded through pip at test
  time: several test folders, `testpaths`, `--strict-config`, `filterwarnings = error`)
  passes under `harness run cpu` exactly as many tests as under plain pytest;
- nox installed there runs this repository's `inventory` session: sessions reuse the
  torch of the virtualenv nox runs from.

The virtualenv is shared by the tests of one run (xdist workers included) through a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
THIRD_PARTY = "toolz==1.2.0"

NEW_PROJECT_TESTS = """\
import pytest
import torch
import torch.distributed as dist


def test_plain():
    assert sum([1, 2]) == 3


@pytest.mark.launch(nproc=2)
def test_all_reduce():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
"""


def base_python() -> str:
    """An interpreter of this Python version without torch (the system one here), else this one."""
    for candidate in (f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}",):
        if not os.access(candidate, os.X_OK):
            continue
        probe = subprocess.run([candidate, "-c", "import torch"], capture_output=True, timeout=60)
        if probe.returncode != 0:
            return candidate
    return sys.executable


def clean_env(venv: Path) -> dict[str, str]:
    """The environment of a user in the virtualenv: its bin first, nothing of this pytest run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "PYTHON", "VIRTUAL_ENV", "NOX_", "COV_"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def sh(cmd: list[str], cwd: Path, venv: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        cmd, cwd=cwd, env=clean_env(venv), capture_output=True, text=True, timeout=timeout
    )
    print(
        f"$ {' '.join(cmd)}  (in {cwd}) -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def _build_venv(where: Path) -> Path:
    venv = where / "venv"
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, timeout=300)
    # Build from a copy: a build in place would leave build/ and *.egg-info in ./harness.
    src = where / "harness-src"
    shutil.copytree(
        REPO / "harness", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    wheels = where / "wheels"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    # With build isolation: the declared build-system requirements must build the metadata.
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)], check=True, timeout=600
    )
    (wheel,) = wheels.glob("pytest_accel_harness-*.whl")
    # The exact torch running here: a local CPU wheel, never a CUDA build from the index.
    subprocess.run(
        [*pip, "install", "-q", "--no-compile", f"torch=={torch.__version__}", str(wheel), "nox"],
        check=True,
        timeout=900,
    )
    return venv


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Path:
    """The adoption virtualenv, built once per run even under xdist (workers share the base temp)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    where = shared / "adoption"
    where.mkdir(exist_ok=True)
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (where / "ready").exists():
            shutil.rmtree(where / "venv", ignore_errors=True)
            _build_venv(where)
            (where / "ready").write_text("")
    return where / "venv"


def venv_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def test_the_venv_has_torch_and_the_harness_but_not_channel_loss(venv):
    py = venv_python(venv)
    done = sh(
        [
            py,
            "-c",
            "import harness, torch, importlib.util as u; "
            "print(torch.__version__, u.find_spec('channel_loss') is None)",
        ],
        venv,
        venv,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [torch.__version__, "True"]
    # The schema and the workflow templates travel inside the wheel, and the plugin is found
    # through its entry point.
    suites = Path(
        sh([py, "-c", "import harness.suites as s; print(s.__file__)"], venv, venv).stdout.strip()
    ).parent
    assert (suites / "schema.json").is_file()
    for template in ("accelerator.yml", "cpu.yml", "gate.yml"):
        assert (suites / "templates" / template).is_file(), template
    listed = sh([py, "-m", "pytest", "--version", "--version"], venv, venv)
    assert "pytest-accel-harness" in listed.stdout + listed.stderr


def test_a_new_project_goes_init_inventory_run_green(venv, tmp_path):
    project = tmp_path / "newproject"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    (project / "tests" / "test_basic.py").write_text(NEW_PROJECT_TESTS)

    init = sh(["harness", "init"], project, venv)
    assert init.returncode == 0, init.stderr
    manifest = json.loads((project / "suites" / "cpu.json").read_text())
    assert [e["paths"] for e in manifest["entries"]] == [["tests"]]

    inventory = sh(["harness", "inventory"], project, venv)
    assert inventory.returncode == 0, inventory.stdout + inventory.stderr
    assert "2 case(s); per suite: cpu 2; 0 problem(s)" in inventory.stdout

    run = sh(["harness", "run", "cpu"], project, venv, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((project / "out" / "harness" / "cpu" / "summary.json").read_text())
    assert summary["total"]["passed"] == 2
    assert summary["total"]["failed"] == summary["total"]["missing"] == 0
    launched = [c for c in summary["cases"] if c["nodeid"].endswith("test_all_reduce")]
    assert [c["outcome"] for c in launched] == ["passed"]

    # Durations flow back: the installed harness folds the run's output into
    # suites/durations/cpu.json, each case's share of the pytest run's wall time.
    refresh = sh(["harness", "durations", "out/harness/cpu"], project, venv)
    assert refresh.returncode == 0, refresh.stderr
    recorded = json.loads((project / "suites" / "durations" / "cpu.json").read_text())["durations"]
    assert sorted(recorded) == [
        "tests/test_basic.py::test_all_reduce",
        "tests/test_basic.py::test_plain",
    ]
    wall = float(
        ET.parse(project / "out" / "harness" / "cpu" / "junit.xml")
        .getroot()
        .find("testsuite")
        .get("time")
    )
    assert sum(recorded.values()) == pytest.approx(wall, abs=0.01)
    matrix = sh(["harness", "matrix", "cpu"], project, venv)
    assert matrix.returncode == 0, matrix.stderr
    (row,) = json.loads(matrix.stdout)["include"]
    assert row["estimated_minutes"] == round(sum(recorded.values()) / 60, 1)


def _pytest_counts(text: str) -> dict[str, int]:
    final = [ln for ln in text.splitlines() if re.search(r"\d+ passed", ln)][-1]
    return {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", final)
    }


def test_a_third_party_suite_passes_the_same_under_the_harness(venv, tmp_path):
    download = sh(
        [
            venv_python(venv),
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(tmp_path),
            THIRD_PARTY,
        ],
        tmp_path,
        venv,
    )
    assert download.returncode == 0, download.stderr
    (sdist,) = tmp_path.glob("toolz-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    project = next(p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("toolz-"))

    # Plain pytest: the project's own configuration, the harness plugin not loaded.
    plain = sh(
        [venv_python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:harness"],
        project,
        venv,
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    expected = _pytest_counts(plain.stdout)
    assert expected["passed"] > 100

    init = sh(["harness", "init"], project, venv)
    assert init.returncode == 0, init.stderr
    run = sh(["harness", "run", "cpu"], project, venv, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    total = json.loads((project / "out" / "harness" / "cpu" / "summary.json").read_text())["total"]
    assert (total["passed"], total["skipped"], total["failed"], total["missing"]) == (
        expected["passed"],
        expected.get("skipped", 0),
        0,
        0,
    )


def test_nox_in_a_virtualenv_reuses_its_torch(venv, tmp_path):
    # The session venv is made from the base interpreter (no torch, where this machine has one
    # without); `--system-site-packages` would inherit that, not the virtualenv nox runs from.
    done = sh(
        [
            str(venv / "bin" / "nox"),
            "-f",
            str(REPO / "noxfile.py"),
            "-s",
            "inventory",
            "--envdir",
            str(tmp_path / "nox"),
            "--",
            "-q",
        ],
        REPO,
        venv,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\d+ case\(s\); per suite: .*; 0 problem\(s\)", done.stdout + done.stderr)
    session_python = tmp_path / "nox" / "inventory" / "bin" / "python"
    where = subprocess.run(
        [str(session_python), "-c", "import torch; print(torch.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(venv),
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
