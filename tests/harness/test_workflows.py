"""The GitHub workflows and nox sessions agree with each other and with the suites."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import stat
import subprocess
from pathlib import Path

import nox.registry
import pytest
import yaml

from harness.suites.manifest import Runner, suite_files
from harness.suites.plan import PlannedCase, plan

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
SUITES = {p.stem for p in suite_files(REPO)}


@pytest.fixture(scope="module")
def sessions() -> dict:
    before = dict(nox.registry.get())
    runpy.run_path(str(REPO / "noxfile.py"))
    found = dict(nox.registry.get())
    # Leave nox's global registry as we found it.
    nox.registry._REGISTRY.clear()
    nox.registry._REGISTRY.update(before)
    return found


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as True
    return doc


def commands(job: dict) -> list[list[str]]:
    """Every shell command line of a job's run steps, split into words."""
    out = []
    for step in job.get("steps", []):
        script = step.get("run", "")
        # ${{ ... }} expressions and $VARS are opaque words here.
        script = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", script)
        for line in script.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or line in ("fi", "else") or line.startswith(("if ", "then")):
                continue
            line = re.sub(r'^\w+="\$\((.*)\)"$', r"\1", line)  # x="$(cmd)" -> cmd
            out.append(shlex.split(line, posix=True))
    return out


def nox_sessions(cmds: list[list[str]]) -> list[tuple[str, list[str]]]:
    found = []
    for words in cmds:
        if words[:1] == ["nox"]:
            i = next(i for i, w in enumerate(words) if w in ("-s", "--session", "--sessions"))
            rest = words[i + 2 :]
            found.append((words[i + 1], rest[1:] if rest[:1] == ["--"] else rest))
    return found


def harness_calls(cmds: list[list[str]]) -> list[list[str]]:
    found = []
    for words in cmds:
        if words[:3] == ["python", "-m", "harness"]:
            found.append(words[3:])
        elif words[:1] == ["harness"]:
            found.append(words[1:])
    return found


ALL = sorted(p.name for p in WORKFLOWS.glob("*.yml"))


def test_expected_workflows_exist():
    assert {"cpu.yml", "gpu.yml", "npu.yml"} <= set(ALL)


def test_nox_sessions_exist_and_reuse_the_interpreters_torch(sessions):
    assert {"tests", "lint", "inventory", "suite-cpu", "suite-gpu", "suite-npu", "bench"} <= set(sessions)
    for name in ("tests", "inventory", "suite-cpu", "suite-gpu", "suite-npu", "bench"):
        assert "--system-site-packages" in (sessions[name].venv_params or []), name
    for suite in SUITES:
        assert f"suite-{suite}" in sessions, f"suites/{suite}.json has no nox session"


@pytest.mark.parametrize("name", ALL)
def test_every_job_names_an_existing_session_or_suite(name, sessions):
    doc = load(name)
    for job_id, job in doc["jobs"].items():
        cmds = commands(job)
        used = nox_sessions(cmds)
        calls = harness_calls(cmds)
        assert used or calls, f"{name}: job {job_id} runs neither a nox session nor harness"
        for session, _ in used:
            assert session in sessions, f"{name}: job {job_id}: no nox session {session!r}"
            if session.startswith("suite-"):
                assert session.removeprefix("suite-") in SUITES, f"{name}: {session} has no suite"
        for call in calls:
            assert call[0] in ("inventory", "run", "matrix"), call
            for suite in (w for w in call[1:] if not w.startswith("-")):
                if call[0] == "inventory" or suite == call[1]:
                    assert suite in SUITES, f"{name}: job {job_id}: no suite {suite!r}"


@pytest.mark.parametrize("name", ALL)
def test_required_checks_are_never_skipped_by_path_filters(name):
    doc = load(name)
    for event, spec in (doc["on"] or {}).items():
        assert not (isinstance(spec, dict) and ({"paths", "paths-ignore"} & set(spec))), f"{name}: {event}"
    for job_id, job in doc["jobs"].items():
        assert "if" not in job, f"{name}: job {job_id} is conditional"


def test_cpu_workflow_runs_lint_inventory_and_the_cpu_suite():
    doc = load("cpu.yml")
    used = {s for job in doc["jobs"].values() for s, _ in nox_sessions(commands(job))}
    assert {"lint", "inventory", "suite-cpu"} <= used
    assert {"pull_request", "push"} <= set(doc["on"])


@pytest.mark.parametrize(("name", "suite"), [("gpu.yml", "gpu"), ("npu.yml", "npu")])
def test_accelerator_workflow_plans_then_runs_its_shards(name, suite):
    doc = load(name)
    jobs = doc["jobs"]
    plan_jobs = [j for j, job in jobs.items() if any(c[:2] == ["matrix", suite] for c in harness_calls(commands(job)))]
    assert len(plan_jobs) == 1, "one plan job running `harness matrix SUITE`"
    (planner,) = plan_jobs
    assert "matrix" in jobs[planner]["outputs"]
    shard_jobs = [j for j, job in jobs.items() if job.get("needs") in (planner, [planner])]
    assert shard_jobs
    for j in shard_jobs:
        job = jobs[j]
        assert job["strategy"]["matrix"] == f"${{{{ fromJSON(needs.{planner}.outputs.matrix) }}}}"
        assert job["runs-on"] == "${{ matrix.runner }}"
        assert job["timeout-minutes"] == "${{ matrix.timeout_minutes }}"
        used = nox_sessions(commands(job))
        assert {s for s, _ in used} == {f"suite-{suite}"}
        assert all("--shard" in args for _, args in used)


def test_matrix_fields_the_workflows_use_exist():
    m = plan("gpu", [Runner(("gpu",), 1, 30, 20, "gpu-1")], [PlannedCase("t::a", "e", 1, 1.0)]).matrix()
    keys = set(m["include"][0])
    for name in ALL:
        for field in re.findall(r"(?<![\w.])matrix\.(\w+)", (WORKFLOWS / name).read_text()):
            assert field in keys, f"{name} uses matrix.{field}, which `harness matrix` does not write"


def test_device_check_script_is_executable_and_asks_for_a_folder():
    script = REPO / "scripts" / "device_check.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 2
    assert "usage" in done.stderr
