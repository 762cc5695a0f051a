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

from harness.suites import init
from harness.suites.manifest import Runner, load_manifest, suite_files
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


def test_nox_sessions_exist_one_per_suite(sessions):
    assert {"tests", "lint", "inventory", "suite-cpu", "suite-gpu", "suite-npu", "bench", "durations"} <= set(sessions)
    for suite in SUITES:
        assert f"suite-{suite}" in sessions, f"suites/{suite}.json has no nox session"
    for name, func in sessions.items():
        # --system-site-packages inherits the *base* interpreter, not a virtualenv nox runs
        # from; sessions reuse nox's own site-packages through a .pth instead (test_adoption
        # runs `nox -s inventory` from a real virtualenv).
        assert "--system-site-packages" not in (func.venv_params or []), name


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
        # The one condition allowed: the fork gate in front of self-hosted runners.
        assert job.get("if", FORK_GATE) == FORK_GATE, f"{name}: job {job_id} is conditional"


# --------------------------------------------------------------------------- what a maintainer merges
# The same rules hold for this repository's workflows and for those `harness init --workflows` writes.

FORK_GATE = "needs.plan.outputs.trusted == 'true'"
PR_ONLY_CANCEL = "${{ github.event_name == 'pull_request' }}"


@pytest.fixture(scope="module")
def init_workflows(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("init")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '0'\n")
    layout = init.PytestLayout(root, None, (), ("tests/test_a.py",), launched_cards=2)
    files = init.render(root, layout, ["cuda", "npu"], workflows=True)
    return {
        f"init:{Path(path).name}": _parsed(text) for path, text in files.items() if path.startswith(".github/")
    }


def _parsed(text: str) -> dict:
    doc = yaml.safe_load(text)
    doc["on"] = doc.pop(True, doc.get("on"))
    return doc


def every_workflow(init_workflows: dict[str, dict]) -> dict[str, dict]:
    return {**{n: load(n) for n in ALL}, **init_workflows}


def self_hosted(job: dict) -> bool:
    runs_on = job.get("runs-on")
    # Runner labels from the matrix come from the suites' manifests: self-hosted ones.
    return runs_on == "${{ matrix.runner }}" or "self-hosted" in (runs_on if isinstance(runs_on, list) else [runs_on])


def test_accelerator_manifests_name_self_hosted_runners():
    # What makes `runs-on: ${{ matrix.runner }}` self-hosted (and so fork-gated) in the workflows.
    for suite in SUITES - {"cpu"}:
        m = load_manifest(REPO / "suites" / f"{suite}.json", REPO)
        assert all("self-hosted" in r.labels for r in m.runners), suite


def test_pull_requests_from_forks_never_reach_self_hosted_runners(init_workflows):
    gated = 0
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            if not self_hosted(job):
                continue
            gated += 1
            assert job.get("if") == FORK_GATE, f"{name}: self-hosted job {job_id} runs for any pull request"
            needs = job["needs"] if isinstance(job["needs"], list) else [job["needs"]]
            assert "plan" in needs
            trusted = doc["jobs"]["plan"]["outputs"]["trusted"]
            assert not self_hosted(doc["jobs"]["plan"]), f"{name}: the gate itself must run GitHub-hosted"
            # Trusted: not a pull request, or one from this repository, or the maintainer's label
            # added to this very commit (a later push from the fork needs it again).
            assert "github.event_name != 'pull_request'" in trusted
            assert "github.event.pull_request.head.repo.full_name == github.repository" in trusted
            assert "github.event.action == 'labeled' && github.event.label.name == 'ci:accelerators'" in trusted
            assert "labeled" in doc["on"]["pull_request"]["types"], f"{name}: adding the label must start a run"
            assert "pull_request_target" not in doc["on"], f"{name}: fork code with a write token"
    assert gated >= 4  # gpu, npu here; gpu, npu from init


def test_cancel_in_progress_only_for_pull_requests(init_workflows):
    for name, doc in every_workflow(init_workflows).items():
        c = doc["concurrency"]
        assert c["cancel-in-progress"] == PR_ONLY_CANCEL, name
        # Outside pull requests every run has its own group: a push to main never cancels
        # (or, pending, replaces) another.
        assert "github.run_id" in c["group"], name
        assert "github.event.pull_request.number" in c["group"], name


def test_pip_is_cached_on_github_hosted_runners(init_workflows):
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            installs = any("pip install" in str(s.get("run", "")) for s in job["steps"])
            if not installs or self_hosted(job):
                continue  # self-hosted runners keep pip's cache themselves
            setup = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")]
            assert setup, f"{name}: job {job_id}"
            assert setup[0]["with"].get("cache") == "pip", f"{name}: job {job_id} downloads every package every run"


def _suite_of(job: dict) -> str | None:
    cmds = commands(job)
    for session, _ in nox_sessions(cmds):
        if session.startswith("suite-"):
            return session.removeprefix("suite-")
    for call in harness_calls(cmds):
        if call[0] == "run":
            return call[1]
    return None


def test_harness_deadline_is_below_the_job_timeout(init_workflows):
    checked = 0
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            suite = _suite_of(job)
            if suite is None:
                continue
            checked += 1
            timeout = job["timeout-minutes"]
            if name.startswith("init:"):
                runner_minutes = init.CPU_RUNNER["timeout_minutes"] if suite == "cpu" else init.ACCELERATOR_TIMEOUT_MINUTES
                runner_limits = [runner_minutes]
            else:
                runner_limits = [r.timeout_minutes for r in load_manifest(REPO / "suites" / f"{suite}.json", REPO).runners]
            if isinstance(timeout, int):
                # `harness run` stops pytest after the runner's timeout_minutes and writes its summary.
                assert timeout > max(runner_limits), f"{name}: job {job_id}"
            else:
                assert timeout == "${{ matrix.job_timeout_minutes }}", f"{name}: job {job_id}"
    m = plan("gpu", [Runner(("gpu",), 1, 30, 20, "gpu-1")], [PlannedCase("t::a", "e", 1, 1.0)]).matrix()
    (row,) = m["include"]
    assert row["job_timeout_minutes"] > row["timeout_minutes"]
    assert checked >= 6  # cpu, gpu, npu here and from init


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
        assert job["timeout-minutes"] == "${{ matrix.job_timeout_minutes }}"
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
