"""GitHub Actions workflows rendered from ``templates/``: those ``harness init --workflows``
writes, and this repository's ``.github/workflows/<accelerator suite>.yml`` (docs/suites.md,
"CI workflows", says what each keeps). Module level imports only the standard library: a
``--no-deps`` install of the harness imports it.
"""

from __future__ import annotations

import contextlib
import json
import re
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
        """The pip requirement, shell-quoted (``file:///`` as ``file://localhost/``: pip before
        24 refuses a URL without a host)."""
        url = re.sub(r"^file:///", "file://localhost/", self.url)
        return f'"{DISTRIBUTION} @ git+{url}@{self.ref}#subdirectory={self.subdirectory}"'


def _https(url: str) -> str | None:
    """A remote's URL as a CI runner can fetch it: ``git@host:o/r`` and ``ssh://`` (which need
    a key) as ``https://host/o/r``; None for a local path or ``file:`` URL."""
    m = re.fullmatch(r"[\w.-]+@([\w.-]+):(?!//)(.+)", url) or re.fullmatch(
        r"ssh://(?:[^@/]+@)?([^/:]+)(?::\d+)?/(.+)", url
    )
    if m:
        return f"https://{m[1]}/{m[2]}"
    return url if url.startswith(("https://", "http://")) else None


def _checkout_source(folder: Path) -> tuple[str | None, str | None, str]:
    """``(URL a CI runner can fetch of a remote whose branch holds HEAD, or None; HEAD;
    subdirectory)`` of the git checkout holding ``folder``."""
    from harness.suites.changes import run_git

    def git(*args: str) -> str | None:
        return (run_git(folder, *args)[0] or "").strip() or None

    commit = git("rev-parse", "HEAD")
    sub = (git("rev-parse", "--show-prefix") or "harness/").rstrip("/") or "."
    branches = git("branch", "-r", "--contains", "HEAD", "--format=%(refname:short)")
    for branch in (branches or "").splitlines():
        url = _https(git("remote", "get-url", branch.split("/", 1)[0]) or "")
        if url:
            return url, commit, sub
    return None, commit, sub


def harness_source(
    ref: str | None = None, direct_url: dict[str, Any] | None = None
) -> HarnessSource:
    """Where the installed harness came from (PEP 610's ``direct_url.json``, or ``direct_url``)
    as a pinned git source: the commit a git install recorded, or the HEAD of the local
    checkout with the URL of a remote holding it; ``ref`` (``--harness-ref``) replaces the
    commit. :class:`HarnessSourceError` when none is known: never a guessed ref."""
    info = direct_url
    if info is None:
        from importlib import metadata

        with contextlib.suppress(metadata.PackageNotFoundError):
            text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
            info = json.loads(text) if text else None
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
    """A workflow's ``pip install`` arguments (``shard_packages``: an accelerator shard job's,
    when it needs less) and the files keying the pip cache of hosted runners."""

    packages: str
    cache_paths: Sequence[str] = ("pyproject.toml",)
    shard_packages: str | None = None


#: The templates (``templates/*.yml``, shipped in the package): ``%{name}`` is a value; a
#: placeholder alone on its line is a block of whole lines (none when empty); a line that
#: starts with ``%{?name}`` is kept only when ``name`` is true.
TEMPLATES = Path(__file__).resolve().parent / "templates"
_PLACEHOLDER = re.compile(r"^%\{\?(\w+)\}(.*\n)|^%\{([\w-]+)\}\n|%\{([\w-]+)\}", re.MULTILINE)


def _render(template: str, **values: Any) -> str:
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    constants = {"cpu_torch": CPU_TORCH, "opt_in": OPT_IN_LABEL, "empty_matrix": EMPTY_MATRIX}
    values = {**ACTIONS, **constants, **values}  # ACTIONS: %{checkout}, %{setup-python}, ...

    def value(m: re.Match[str]) -> str:
        if m[1]:  # a line kept only when its flag is true
            return _PLACEHOLDER.sub(value, m[2]) if values[m[1]] else ""
        return values[m[3] or m[4]]

    return _PLACEHOLDER.sub(value, text)


def _lines(indent: int, lines: Sequence[str]) -> str:
    return "".join(f"{' ' * indent}{line}\n" for line in lines)


#: What the gate accepts from an empty plan: ``harness matrix`` prints this when nothing runs.
EMPTY_MATRIX = '{"include":[]}'


def gate_job(suite: str, needs: Sequence[str], *, planned: bool) -> str:
    """The suite's required check (``templates/gate.yml``): the job ``SUITE gate``, ``if:
    always()``, red unless every job of ``needs`` succeeded or was skipped for an empty plan
    (``planned``: the workflow has a plan job; an untrusted run with shards planned is red)."""
    return _render("gate.yml", suite=suite, needs=", ".join(needs), planned=planned)


def accelerator_workflow(
    suite: str,
    device: str,
    install: Install,
    *,
    name: str | None = None,
    header: str = "",
    runners: Sequence[Any] = (),
) -> str:
    """The workflow of an accelerator suite (``templates/accelerator.yml``): a hosted plan job
    (``harness matrix``), a self-hosted shard job per matrix row in the ``container`` of
    ``runners`` (the suite's :class:`~harness.suites.manifest.Runner` classes), and the gate.
    ``name``: the workflow's (default ``suite``); ``header``: ``#`` lines put above it all."""
    from harness.devices import device_type

    container = next((r.container for r in runners if r.container), None) or {}
    return _render(
        "accelerator.yml",
        header=header,
        suite=suite,
        name=name or suite,
        title=device_type(device).title,
        cache_paths=_lines(12, install.cache_paths),
        packages=install.packages,
        shard_packages=install.shard_packages or install.packages,
        container=_lines(4, ["container:"] * bool(container))
        + _lines(6, [f"{k}: {json.dumps(v)}" for k, v in container.items()]),
        gate=gate_job(suite, ["plan", "suite"], planned=True),
    )


#: This repository's own install; a shard job's is only what the accelerator cases import
#: (a test checks it against the `test` extra: not its linters, nox or workflow auditors).
REPO_INSTALL = Install(
    '-e ".[test]" ./harness',
    ("pyproject.toml", "harness/pyproject.toml"),
    shard_packages='-e ".[hf,plot,peft]" ./harness "hypothesis>=6.100" numpy',
)


REPO_ROOT = Path(__file__).resolve().parents[2]


def repository_workflows(root: Path = REPO_ROOT) -> dict[str, str]:
    """This repository's workflows: ``.github/workflows/SUITE.yml`` -> content, one per suite
    in ``root/suites/*.json`` whose device is an accelerator."""
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
    content, for the cpu suite (``templates/cpu.yml``; its job's limit
    :data:`~harness.suites.plan.JOB_SETUP_MINUTES` above ``cpu_timeout_minutes``) and each
    ``(suite, device, runners)`` accelerator suite; the harness installed from ``source``, the
    project (a ``pyproject.toml`` or ``setup.py``) from the checkout."""
    from harness.suites.plan import JOB_SETUP_MINUTES

    project = [f for f in ("pyproject.toml", "setup.py") if (root / f).exists()]
    packages = source.requirement() + (" -e ." if project else "")
    install = Install(packages, tuple(project) or ("**/requirements*.txt",))
    header = (
        "# Written by `harness init`. Add your project's test extra to the pip install lines\n"
        '# (e.g. -e ".[test]").\n'
    )
    cpu = _render(
        "cpu.yml",
        header=header,
        name="harness-cpu",
        timeout_minutes=str(cpu_timeout_minutes),
        job_timeout_minutes=str(cpu_timeout_minutes + JOB_SETUP_MINUTES),
        cache_paths=_lines(12, install.cache_paths),
        packages=install.packages,
        gate=gate_job("cpu", ["cpu"], planned=False),
    )
    files = {".github/workflows/harness-cpu.yml": cpu}
    for suite, device, runners in suites:
        files[f".github/workflows/harness-{suite}.yml"] = accelerator_workflow(
            suite, device, install, name=f"harness-{suite}", header=header, runners=runners
        )
    return files
