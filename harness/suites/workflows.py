"""GitHub Actions workflows for suites: the one template of each kind.

``harness init --workflows`` writes these into any repository, and this repository's own
``.github/workflows/gpu.yml`` and ``npu.yml`` are this module's output too (a test compares
them), so a fix to the template reaches every copy. The rules every rendered workflow keeps:

- each workflow ends in one gate job of a stable name (``SUITE gate``, :func:`gate_job`):
  ``if: always()``, ``needs`` every other job, red unless each succeeded; it is the
  required check;
- no path filters; on a pull request the plan job runs
  ``harness matrix SUITE --changed-from origin/BASE``, and when the change needs no shard
  (``{"include": []}``, e.g. a docs-only pull request) the shard job is skipped by its
  ``if:`` without taking a self-hosted runner, and the gate passes;
- pull requests from forks never reach self-hosted runners unless a maintainer adds
  :data:`OPT_IN_LABEL` (it opts in the commit labelled, not later pushes);
- a new push to a pull request cancels its older run; a label event never cancels a run:
  the opt-in label queues behind the pull request's run, any other label runs in a group of
  its own and plans nothing;
- actions are pinned by full commit SHA (:data:`ACTIONS`), checkouts keep no credentials;
- on self-hosted runners nothing is installed into the image's (externally managed) Python:
  a virtualenv over it (``--system-site-packages``, so the image's own torch is used) holds
  the harness and the project;
- the harness comes from the checkout (``./harness`` here) or a git commit the installed
  harness knows it came from (:func:`harness_source`), never from a guessed tag or a
  package name anyone could register on the public index.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from harness.errors import HarnessError

#: The label a maintainer sets on a pull request from a fork to run its accelerator shards.
OPT_IN_LABEL = "ci:accelerators"

#: Every action the workflows use, pinned by commit SHA (``# tag`` says which release).
ACTIONS = {
    "checkout": "actions/checkout@d23441a48e516b6c34aea4fa41551a30e30af803  # v6.1.0",
    "setup-python": "actions/setup-python@ece7cb06caefa5fff74198d8649806c4678c61a1  # v6.3.0",
    "upload-artifact": "actions/upload-artifact@b7c566a772e6b6bfb58ed0dc250532a479d7789f  # v6.0.0",
}

#: The CPU build of torch on GitHub-hosted runners: on the public index the Linux wheel of
#: ``torch`` is the multi-GB CUDA build.
CPU_TORCH = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

#: The repository the harness is developed in (its ``harness/`` folder is the distribution).
HARNESS_REPO = "https://github.com/channel-loss/channel-loss"
#: The harness distribution's name (not on the public index: never installed by name).
DISTRIBUTION = "pytest-accel-harness"


class HarnessSourceError(HarnessError):
    """The installed harness cannot say which commit it came from, and no ref was given."""


@dataclass(frozen=True)
class HarnessSource:
    """Where a workflow installs the harness from: ``git+URL@REF#subdirectory=SUB``."""

    url: str
    ref: str
    subdirectory: str = "harness"

    def requirement(self) -> str:
        """The pip requirement, shell-quoted (a local ``file:///`` URL as
        ``file://localhost/``: pip before 24 refuses a URL without a host)."""
        url = re.sub(r"^file:///", "file://localhost/", self.url)
        return f'"{DISTRIBUTION} @ git+{url}@{self.ref}#subdirectory={self.subdirectory}"'


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _https(url: str) -> str | None:
    """A remote's URL as pip can fetch it on a CI runner: scp-like ``git@host:o/r`` and
    ``ssh://`` (which need a key the runner lacks) become ``https://host/o/r``; a local path
    or ``file:`` URL, which no runner reaches, is None."""
    m = re.fullmatch(r"[\w.-]+@([\w.-]+):(?!//)(.+)", url) or re.fullmatch(
        r"ssh://(?:[^@/]+@)?([^/:]+)(?::\d+)?/(.+)", url
    )
    if m:
        return f"https://{m[1]}/{m[2]}"
    return url if url.startswith(("https://", "http://")) else None


def _checkout_source(folder: Path) -> tuple[str | None, str | None, str]:
    """``(URL a CI runner can fetch of a remote whose branch holds HEAD, or None; HEAD;
    subdirectory)`` of the git checkout holding ``folder``."""
    commit = _git(folder, "rev-parse", "HEAD")
    sub = (_git(folder, "rev-parse", "--show-prefix") or "harness/").rstrip("/") or "."
    branches = _git(folder, "branch", "-r", "--contains", "HEAD", "--format=%(refname:short)")
    for branch in (branches or "").splitlines():
        url = _https(_git(folder, "remote", "get-url", branch.split("/", 1)[0]) or "")
        if url:
            return url, commit, sub
    return None, commit, sub


def _direct_url() -> dict[str, Any] | None:
    from importlib import metadata

    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(text) if text else None


def harness_source(
    ref: str | None = None, direct_url: dict[str, Any] | None = None
) -> HarnessSource:
    """Where the installed harness came from, as a pinned git source (PEP 610's
    ``direct_url.json``, or ``direct_url``): the commit a git install recorded, or the HEAD
    of the local checkout it was installed from with the URL of a remote holding it.
    ``ref`` (``--harness-ref``) replaces the commit. Raises :class:`HarnessSourceError`
    when neither says where an install can come from: a workflow never gets a guessed ref."""
    info = _direct_url() if direct_url is None else direct_url
    url, commit, sub = None, None, "harness"
    if info:
        sub = info.get("subdirectory", sub)
        vcs = info.get("vcs_info") or {}
        if vcs.get("vcs") == "git":
            url, commit = info.get("url"), vcs.get("commit_id")
        elif "dir_info" in info and str(info.get("url", "")).startswith("file:"):
            url, commit, sub = _checkout_source(Path(url2pathname(urlparse(info["url"]).path)))
    if ref:
        return HarnessSource(url or HARNESS_REPO, ref, sub)
    if url and commit:
        return HarnessSource(url, commit, sub)
    came = (
        f"the local checkout at commit {commit}, which no remote a CI runner can reach holds"
        if commit
        else "no git commit (a wheel, or a copied source tree)"
    )
    raise HarnessSourceError(
        f"the installed harness came from {came}: the workflows would install it from a ref "
        f"that may not exist; pass --harness-ref REF (a commit or tag of {HARNESS_REPO}), or "
        "install the harness from git (pip install "
        f'"{DISTRIBUTION} @ git+{HARNESS_REPO}@COMMIT#subdirectory=harness")'
    )


@dataclass(frozen=True)
class Install:
    """How a workflow installs what it runs: ``packages``, the ``pip install`` arguments
    (e.g. ``-e ".[test]" ./harness``); ``shard_packages``, an accelerator shard job's when
    it needs less; ``cache_paths``, the files keying the pip cache of hosted runners."""

    packages: str
    cache_paths: Sequence[str] = ("pyproject.toml",)
    shard_packages: str | None = None


_CONCURRENCY = f"""\
# A new push to a pull request cancels its older run; a label event never cancels one (the
# opt-in label queues behind the pull request's run, any other label runs in a group of its
# own and plans nothing); pushes to main and manual runs each get their own group.
concurrency:
  group: ${{{{ github.workflow }}}}-${{{{ github.event_name == 'pull_request' && (github.event.action != 'labeled' || github.event.label.name == '{OPT_IN_LABEL}') && github.event.pull_request.number || github.run_id }}}}
  cancel-in-progress: ${{{{ github.event_name == 'pull_request' && github.event.action != 'labeled' }}}}
"""

_CPU_CONCURRENCY = """\
# One run per pull request (a new push cancels the older run); pushes to main and manual runs
# each get their own group and are never cancelled.
concurrency:
  group: ${{ github.workflow }}-${{ github.event_name == 'pull_request' && github.event.pull_request.number || github.run_id }}
  cancel-in-progress: ${{ github.event_name == 'pull_request' }}
"""


_CHECKOUT = f"""\
      - uses: {ACTIONS["checkout"]}
        with:
          fetch-depth: 0  # --changed-from needs the merge base
          persist-credentials: false
"""


def _hosted_python(install: Install) -> str:
    paths = "".join(f"            {p}\n" for p in install.cache_paths)
    return (
        f"      - uses: {ACTIONS['setup-python']}\n"
        "        with:\n"
        '          python-version: "3.11"\n'
        "          cache: pip\n"
        "          cache-dependency-path: |\n"
        f"{paths}"
    )


def _upload(name: str, path: str) -> str:
    return (
        f"      - uses: {ACTIONS['upload-artifact']}\n"
        "        if: always()\n"
        "        with:\n"
        f"          name: {name}\n"
        f"          path: {path}\n"
    )


#: What the gate accepts from an empty plan: ``harness matrix`` prints this when nothing runs.
EMPTY_MATRIX = '{"include":[]}'


def gate_job(suite: str, needs: Sequence[str], *, planned: bool) -> str:
    """The suite's required check: a job of a stable name (``SUITE gate``), ``if: always()``,
    red unless every other job succeeded or was skipped for an empty plan (``planned``: the
    workflow has a plan job; an untrusted run with shards planned is red)."""
    untrusted = (
        f"""          if [ "$TRUSTED" != true ] && [ "$MATRIX" != '{EMPTY_MATRIX}' ]; then
            echo "::error::shards were planned and not run: a pull request from a fork runs them once a maintainer adds the label {OPT_IN_LABEL}"
            exit 1
          fi
"""
        if planned
        else ""
    )
    plan_env = (
        "          TRUSTED: ${{ needs.plan.outputs.trusted }}\n"
        "          MATRIX: ${{ needs.plan.outputs.matrix }}\n"
        if planned
        else ""
    )
    return f"""
  # The required check (branch protection): the shard jobs' names change with the plan, and a
  # job skipped by its `if:` counts as passed, so this one job gathers them all.
  gate:
    name: {suite} gate
    if: always()
    needs: [{", ".join(needs)}]
    runs-on: ubuntu-latest
    timeout-minutes: 5
    steps:
      - name: Every job succeeded (a shard job skipped for an empty plan counts)
        env:
          RESULTS: ${{{{ join(needs.*.result, ' ') }}}}
{plan_env}        run: |
          echo "jobs: $RESULTS"
          for result in $RESULTS; do
            if [ "$result" != success ] && [ "$result" != skipped ]; then
              echo "::error::a job of the suite ended $result"
              exit 1
            fi
          done
{untrusted}"""


def _container(runners: Sequence[Any]) -> str:
    """The shard job's ``container:``: the runner classes' ``container`` (image and
    options; one for all classes of a suite, the manifest checks), or none: on the host."""
    spec = next((r.container for r in runners if r.container), None)
    if spec is None:
        return ""
    return "    container:\n" + "".join(f"      {k}: {json.dumps(v)}\n" for k, v in spec.items())


def accelerator_workflow(
    suite: str,
    device: str,
    install: Install,
    *,
    name: str | None = None,
    header: str = "",
    runners: Sequence[Any] = (),
) -> str:
    """The workflow of an accelerator suite: a GitHub-hosted plan job (``harness matrix``),
    one self-hosted shard job per matrix row (``harness run --shard``) in the ``container``
    of ``runners`` (the suite's :class:`~harness.suites.manifest.Runner` classes), and the
    gate (:func:`gate_job`). ``name``: the workflow's (default ``suite``); ``header``:
    ``#`` lines put above the generated description."""
    from harness.devices import device_type

    title = device_type(device).title
    return f"""\
{header}# {title} CI: a plan job turns suites/{suite}.json into a matrix of shards
# (`harness matrix`, balanced on recorded durations, each shard within its runner's budget);
# each shard job runs `harness run --shard` for its shard on its self-hosted runner; the
# gate job `{suite} gate` fails unless every shard passed: make it the required check.
# No path filters: on a pull request the plan covers only what the change needs
# (`--changed-from`); when that is nothing, no shard job starts and the gate passes.
#
# Pull requests from forks never reach the self-hosted runners: the plan job (GitHub-hosted)
# marks such a run untrusted and the shard jobs do not start, unless a maintainer adds the
# label `{OPT_IN_LABEL}`, which opts in the commit it was added on (a later push needs the
# label again).
name: {name or suite}

on:
  pull_request:
    types: [opened, synchronize, reopened, labeled]
  push:
    branches: [main]
  workflow_dispatch:
    inputs:
      target_minutes:
        description: "Planned minutes per shard (empty: the runner's budget)"
        required: false
        default: ""

{_CONCURRENCY}
permissions:
  contents: read

env:
  PIP_DISABLE_PIP_VERSION_CHECK: "1"

jobs:
  plan:
    runs-on: ubuntu-latest
    timeout-minutes: 15
    outputs:
      matrix: ${{{{ steps.matrix.outputs.matrix }}}}
      trusted: ${{{{ github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository || (github.event.action == 'labeled' && github.event.label.name == '{OPT_IN_LABEL}') }}}}
    steps:
{_CHECKOUT}{_hosted_python(install)}      - name: Install what planning needs (it collects the tests; CPU torch is enough)
        run: |
          python -m pip install {CPU_TORCH}
          python -m pip install {install.packages}
      - id: matrix
        name: Plan shards
        env:
          ACTION: ${{{{ github.event.action }}}}
          LABEL: ${{{{ github.event.label.name }}}}
          BASE_REF: ${{{{ github.base_ref }}}}
          TARGET_MINUTES: ${{{{ inputs.target_minutes }}}}
        run: |
          args=()
          if [ -n "$BASE_REF" ]; then args+=(--changed-from "origin/$BASE_REF"); fi
          if [ -n "$TARGET_MINUTES" ]; then args+=(--target-minutes "$TARGET_MINUTES"); fi
          if [ "$ACTION" = labeled ] && [ "$LABEL" != "{OPT_IN_LABEL}" ]; then
            matrix='{{"include":[]}}'
          else
            matrix="$(python -m harness matrix {suite} "${{args[@]}}")"
          fi
          echo "$matrix"
          echo "matrix=$matrix" >> "$GITHUB_OUTPUT"

  suite:
    needs: plan
    # Self-hosted: never for an untrusted pull request from a fork (see the top), and no
    # runner at all when the plan has no shard.
    if: needs.plan.outputs.trusted == 'true' && fromJSON(needs.plan.outputs.matrix).include[0] != null
    name: {suite} ${{{{ matrix.shard }}}}
    strategy:
      fail-fast: false
      matrix: ${{{{ fromJSON(needs.plan.outputs.matrix) }}}}
    runs-on: ${{{{ matrix.runner }}}}
    # `harness run` stops pytest at matrix.timeout_minutes and still writes its summary; the
    # job's own limit adds time for checkout and install.
    timeout-minutes: ${{{{ matrix.job_timeout_minutes }}}}
{_container(runners)}    steps:
{_CHECKOUT}      - name: Install into a virtualenv over the image's Python
        run: |
          # The image's Python is externally managed and ships torch for {title}: a venv over
          # its packages adds only what is missing and leaves the image untouched. Self-hosted
          # runners keep pip's cache between jobs.
          python3 -m venv --system-site-packages "$RUNNER_TEMP/venv"
          "$RUNNER_TEMP/venv/bin/python" -m pip install {install.shard_packages or install.packages}
          echo "$RUNNER_TEMP/venv/bin" >> "$GITHUB_PATH"
      - name: {title} suite, shard ${{{{ matrix.shard }}}}
        env:
          BASE_REF: ${{{{ github.base_ref }}}}
          SHARD: ${{{{ matrix.shard }}}}
        run: |
          out="out/harness/{suite}-${{SHARD/\\//of}}"
          if [ -n "$BASE_REF" ]; then
            python -m harness run {suite} --shard "$SHARD" --changed-from "origin/$BASE_REF" --out "$out"
          else
            python -m harness run {suite} --shard "$SHARD" --out "$out"
          fi
      # plan.json + JUnit XML: the recorded durations are refreshed from a push run's artifacts.
{_upload(f"harness-{suite}-${{{{ strategy.job-index }}}}", "out/harness/")}{gate_job(suite, ["plan", "suite"], planned=True)}"""


def cpu_workflow(
    install: Install, *, timeout_minutes: int, name: str = "harness-cpu", header: str = ""
) -> str:
    """The workflow of a CPU suite on a GitHub-hosted runner: the inventory, then
    ``harness run cpu`` (``--changed-from`` on pull requests). ``timeout_minutes`` is the
    suite's runner timeout; the job's own limit is 10 minutes above it."""
    return f"""\
{header}# The inventory and the CPU suite on every pull request and push; the gate job `cpu gate` is
# the check to require. No path filters: on a pull request `--changed-from` decides what it
# tests.
name: {name}

on:
  pull_request:
  push:
    branches: [main]
  workflow_dispatch:

{_CPU_CONCURRENCY}
permissions:
  contents: read

env:
  PIP_DISABLE_PIP_VERSION_CHECK: "1"

jobs:
  cpu:
    runs-on: ubuntu-latest
    # Above the suite's runner timeout_minutes ({timeout_minutes}), where `harness run` stops pytest
    # and still writes its summary.
    timeout-minutes: {timeout_minutes + 10}
    steps:
{_CHECKOUT}{_hosted_python(install)}      - name: Install
        run: |
          python -m pip install {CPU_TORCH}
          python -m pip install {install.packages}
      - run: python -m harness inventory
      - name: CPU suite
        env:
          BASE_REF: ${{{{ github.base_ref }}}}
        run: |
          if [ -n "$BASE_REF" ]; then
            python -m harness run cpu --changed-from "origin/$BASE_REF" --out out/harness/cpu
          else
            python -m harness run cpu --out out/harness/cpu
          fi
{_upload("harness-cpu", "out/harness/cpu")}{gate_job("cpu", ["cpu"], planned=False)}"""


#: This repository's own install: the project with its test extra, the harness from the
#: checkout; a shard job gets only what the accelerator cases import (the `test` extra's
#: requirements, a test checks: not its linters, nox or the workflow auditors).
REPO_INSTALL = Install(
    '-e ".[test]" ./harness',
    ("pyproject.toml", "harness/pyproject.toml"),
    shard_packages='-e ".[hf,plot,peft]" ./harness "hypothesis>=6.100" numpy',
)


#: This repository's root (the harness package is its ``harness/`` folder).
REPO_ROOT = Path(__file__).resolve().parents[2]


def repository_workflows(root: Path = REPO_ROOT) -> dict[str, str]:
    """This repository's accelerator workflows: ``.github/workflows/SUITE.yml`` -> content,
    one per suite in ``root/suites/*.json`` whose device is an accelerator (a new device's
    suite gets its workflow from the same template, and a test finds it missing)."""
    from harness.devices import ACCELERATOR_NAMES
    from harness.suites.manifest import read_json, read_runners, suite_files

    out = {}
    for path in suite_files(root):
        doc = read_json(path, root)
        if doc.get("device") in ACCELERATOR_NAMES:
            out[f".github/workflows/{path.stem}.yml"] = accelerator_workflow(
                path.stem, doc["device"], REPO_INSTALL, runners=read_runners(doc)
            )
    return out


def init_workflows(
    root: Path,
    suites: Sequence[tuple[str, str, Sequence[Any]]],
    *,
    cpu_timeout_minutes: int,
    source: HarnessSource,
) -> dict[str, str]:
    """What ``harness init --workflows`` writes: ``.github/workflows/harness-SUITE.yml`` ->
    content, for the cpu suite and each ``(suite, device, runners)`` accelerator suite; the
    harness installed from ``source``, the project (a ``pyproject.toml`` or ``setup.py``)
    from the checkout."""
    project = [f for f in ("pyproject.toml", "setup.py") if (root / f).exists()]
    packages = source.requirement() + (" -e ." if project else "")
    install = Install(packages, tuple(project) or ("**/requirements*.txt",))
    header = (
        "# Written by `harness init`. Add your project's test extra to the pip install lines\n"
        '# (e.g. -e ".[test]").\n'
    )
    files = {
        ".github/workflows/harness-cpu.yml": cpu_workflow(
            install, timeout_minutes=cpu_timeout_minutes, header=header
        )
    }
    for suite, device, runners in suites:
        files[f".github/workflows/harness-{suite}.yml"] = accelerator_workflow(
            suite, device, install, name=f"harness-{suite}", header=header, runners=runners
        )
    return files
