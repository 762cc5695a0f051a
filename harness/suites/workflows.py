"""GitHub Actions workflows for suites: the one template of each kind.

``harness init --workflows`` writes these into any repository, and this repository's own
``.github/workflows/gpu.yml`` and ``npu.yml`` are this module's output too (a test compares
them), so a fix to the template reaches every copy. The rules every rendered workflow keeps:

- the required checks always run (no path filters); on a pull request the plan job runs
  ``harness matrix SUITE --changed-from origin/BASE``, and when the change needs no shard
  (``{"include": []}``, e.g. a docs-only pull request) the shard job is skipped by its
  ``if:`` without taking a self-hosted runner, while the plan job still reports;
- pull requests from forks never reach self-hosted runners unless a maintainer adds
  :data:`OPT_IN_LABEL` (it opts in the commit labelled, not later pushes);
- a new push to a pull request cancels its older run; a label event never cancels a run:
  the opt-in label queues behind the pull request's run, any other label runs in a group of
  its own and plans nothing;
- actions are pinned by full commit SHA (:data:`ACTIONS`), checkouts keep no credentials;
- on self-hosted runners nothing is installed into the image's (externally managed) Python:
  a virtualenv over it (``--system-site-packages``, so the image's own torch is used) holds
  the harness and the project;
- the harness comes from the checkout (``./harness`` here) or a pinned git ref, never from
  a package name anyone could register on the public index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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

#: Where ``harness init`` workflows install the harness from: this project's repository at a
#: git ref, the installed harness's release tag (replace it by a commit SHA to pin it
#: immutably).
HARNESS_GIT = "git+https://github.com/channel-loss/channel-loss@{ref}#subdirectory=harness"


@dataclass(frozen=True)
class Install:
    """How a workflow installs what it runs.

    ``packages``: the ``pip install`` arguments for the project and the harness (e.g.
    ``-e ".[test]" ./harness``); ``cache_paths``: the files whose hash keys the pip cache of
    GitHub-hosted runners.
    """

    packages: str
    cache_paths: Sequence[str] = ("pyproject.toml",)


def harness_requirement(ref: str) -> str:
    """The pip requirement (shell-quoted) ``harness init`` workflows install the harness
    with: :data:`HARNESS_GIT` at the git ``ref``."""
    return f'"pytest-accel-harness @ {HARNESS_GIT.format(ref=ref)}"'


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


def _checkout(indent: str = "      ", full_history: bool = False) -> str:
    depth = (
        f"{indent}    fetch-depth: 0  # --changed-from needs the merge base\n"
        if full_history
        else ""
    )
    return (
        f"{indent}- uses: {ACTIONS['checkout']}\n"
        f"{indent}  with:\n{depth}"
        f"{indent}    persist-credentials: false\n"
    )


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


def accelerator_workflow(
    suite: str, device: str, install: Install, *, name: str | None = None, header: str = ""
) -> str:
    """The workflow of an accelerator suite: a GitHub-hosted plan job (``harness matrix``)
    and one self-hosted shard job per matrix row (``harness run --shard``).

    ``name`` is the workflow's name (default ``suite``); ``header``, comment lines (each
    starting with ``#``) put above the generated description.
    """
    from harness.devices import device_type

    title = device_type(device).title
    return f"""\
{header}# {title} CI: a plan job turns suites/{suite}.json into a matrix of shards
# (`harness matrix`, balanced on recorded durations, each shard within its runner's budget);
# each shard job runs `harness run --shard` for its shard on its self-hosted runner.
# No path filters: on a pull request the plan covers only what the change needs
# (`--changed-from`); when that is nothing, no shard job starts and the plan job still reports.
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
{_checkout(full_history=True)}{_hosted_python(install)}      - name: Install what planning needs (it collects the tests; CPU torch is enough)
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
    steps:
{_checkout(full_history=True)}      - name: Install into a virtualenv over the image's Python
        run: |
          # The image's Python is externally managed and ships torch for {title}: a venv over
          # its packages adds only what is missing and leaves the image untouched. Self-hosted
          # runners keep pip's cache between jobs.
          python3 -m venv --system-site-packages "$RUNNER_TEMP/venv"
          "$RUNNER_TEMP/venv/bin/python" -m pip install {install.packages}
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
{_upload(f"harness-{suite}-${{{{ strategy.job-index }}}}", "out/harness/")}"""


def cpu_workflow(
    install: Install, *, timeout_minutes: int, name: str = "harness-cpu", header: str = ""
) -> str:
    """The workflow of a CPU suite on a GitHub-hosted runner: the inventory, then
    ``harness run cpu`` (``--changed-from`` on pull requests). ``timeout_minutes`` is the
    suite's runner timeout; the job's own limit is 10 minutes above it."""
    return f"""\
{header}# The inventory and the CPU suite on every pull request and push. No path filters: this is
# a required check; on a pull request `--changed-from` decides what it tests.
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
{_checkout(full_history=True)}{_hosted_python(install)}      - name: Install
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
{_upload("harness-cpu", "out/harness/cpu")}"""


#: This repository's own install: the project with its test extra, the harness from the checkout.
REPO_INSTALL = Install('-e ".[test]" ./harness', ("pyproject.toml", "harness/pyproject.toml"))


#: This repository's root (the harness package is its ``harness/`` folder).
REPO_ROOT = Path(__file__).resolve().parents[2]


def repository_workflows(root: Path = REPO_ROOT) -> dict[str, str]:
    """This repository's accelerator workflows: ``.github/workflows/SUITE.yml`` -> content,
    one per suite in ``root/suites/*.json`` whose device is an accelerator (a new device's
    suite gets its workflow from the same template, and a test finds it missing)."""
    from harness.devices import ACCELERATOR_NAMES
    from harness.suites.manifest import read_json, suite_files

    out = {}
    for path in suite_files(root):
        device = read_json(path, root).get("device")
        if device in ACCELERATOR_NAMES:
            out[f".github/workflows/{path.stem}.yml"] = accelerator_workflow(
                path.stem, device, REPO_INSTALL
            )
    return out


def _harness_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("pytest-accel-harness")
    except metadata.PackageNotFoundError:
        return None


def init_workflows(
    root: Path, suites: Sequence[tuple[str, str]], *, cpu_timeout_minutes: int
) -> dict[str, str]:
    """What ``harness init --workflows`` writes for the repository at ``root``:
    ``.github/workflows/harness-SUITE.yml`` -> content, for the cpu suite and each
    ``(suite, device)`` accelerator suite.

    The harness is installed from its git repository at the installed harness's release
    tag, the project itself (when ``root`` has a ``pyproject.toml`` or ``setup.py``) from
    the checkout.
    """
    version = _harness_version()
    # A source tree without metadata has no release to name: its default branch, to pin.
    harness = harness_requirement(f"v{version}" if version else "main")
    project = [f for f in ("pyproject.toml", "setup.py") if (root / f).exists()]
    packages = harness + (" -e ." if project else "")
    install = Install(packages, tuple(project) or ("**/requirements*.txt",))
    header = (
        "# Written by `harness init`. Add your project's test extra to the pip install lines\n"
        '# (e.g. -e ".[test]"); pin the harness ref to a commit SHA to make it immutable.\n'
    )
    files = {
        ".github/workflows/harness-cpu.yml": cpu_workflow(
            install, timeout_minutes=cpu_timeout_minutes, header=header
        )
    }
    for suite, device in suites:
        files[f".github/workflows/harness-{suite}.yml"] = accelerator_workflow(
            suite, device, install, name=f"harness-{suite}", header=header
        )
    return files
