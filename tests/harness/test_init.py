"""`harness init`: suites from pytest's own configuration, idempotent, never overwriting unasked.

Each test runs the real `harness` command (``python -m harness``) in a subprocess on a
scratch project, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml

from harness.suites.manifest import load_schema

# The devices named, not `harness.DEVICES`: a device type added to the table must not
# leave these projects with cases no suite `init --accelerators cuda,npu` wrote owns.
LAUNCHED_DEVICE_TEST = """\
import pytest
import torch.distributed as dist


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
@pytest.mark.launch(nproc=2)
def test_world(device):
    assert dist.get_world_size() == 2
"""


#: `--workflows` with the harness ref pinned: the harness these tests run is an editable
#: install of a checkout whose commit no remote may hold (see test_workflows for the source).
WORKFLOWS = ("--workflows", "--harness-ref", "0123456789abcdef0123456789abcdef01234567")


def harness(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def manifest(root: Path, name: str) -> dict:
    doc = json.loads((root / "suites" / name).read_text())
    jsonschema.validate(doc, load_schema())  # the schema inside the installed harness
    return doc


def test_owns_the_configured_testpaths_and_is_idempotent(tmp_path):
    root = write(
        tmp_path,
        {
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests", "docs"]\n',
            "tests/test_a.py": "def test_a():\n    pass\n",
            "tests/unit/test_b.py": "def test_b():\n    pass\n",
            "docs/index.md": "no tests here\n",
            "scratch/test_elsewhere.py": "def test_c():\n    pass\n",  # outside testpaths: pytest never collects it
        },
    )
    done = harness(root, "init")
    assert done.returncode == 0, done.stderr
    assert "inifile" in done.stdout
    assert "pyproject.toml" in done.stdout
    doc = manifest(root, "cpu.json")
    assert doc["suite"] == "cpu"
    assert doc["device"] == "cpu"
    assert [e["paths"] for e in doc["entries"]] == [["tests"]]
    written = (root / "suites" / "cpu.json").read_bytes()

    again = harness(root, "init")
    assert again.returncode == 0, again.stderr
    assert "unchanged" in again.stdout
    assert (root / "suites" / "cpu.json").read_bytes() == written

    inv = harness(root, "inventory")
    assert inv.returncode == 0, inv.stdout + inv.stderr
    assert "2 case(s)" in inv.stdout


def test_follows_python_files_without_testpaths(tmp_path):
    root = write(
        tmp_path,
        {
            "pytest.ini": "[pytest]\npython_files = check_*.py\n",
            "check_top.py": "def test_top():\n    pass\n",
            "checks/deep/check_one.py": "def test_one():\n    pass\n",
            "checks/check_two.py": "def test_two():\n    pass\n",
            "other/test_not_collected.py": "def test_no():\n    pass\n",
        },
    )
    done = harness(root, "init")
    assert done.returncode == 0, done.stderr
    assert "pytest.ini" in done.stdout
    doc = manifest(root, "cpu.json")
    assert sorted(p for e in doc["entries"] for p in e["paths"]) == ["check_top.py", "checks"]


def test_keeps_your_manifest_and_refuses_to_overwrite_other_files_without_force(tmp_path):
    # Regression: a suite you had edited made `harness init --workflows` refuse (exit 2),
    # and --force dropped your edits: no way to add the workflows to a customized suite.
    root = write(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"})
    assert harness(root, "init").returncode == 0
    edited = (
        (root / "suites" / "cpu.json")
        .read_text()
        .replace('"timeout_minutes": 30', '"timeout_minutes": 45')
    )
    (root / "suites" / "cpu.json").write_text(edited)

    kept = harness(root, "init", *WORKFLOWS)
    assert kept.returncode == 0, kept.stderr
    assert "suites/cpu.json exists with other content: kept as it is" in kept.stderr
    assert (root / "suites" / "cpu.json").read_text() == edited
    workflow = (root / ".github/workflows/harness-cpu.yml").read_text()
    assert "timeout-minutes: 55" in workflow, workflow  # follows your suite (45) + 10

    (root / ".github/workflows/harness-cpu.yml").write_text(
        workflow.replace("timeout-minutes: 55", "timeout-minutes: 40")  # as before the edit
    )
    refused = harness(root, "init", *WORKFLOWS)
    assert refused.returncode == 2
    assert ".github/workflows/harness-cpu.yml exists with other content" in refused.stderr
    assert "--force" in refused.stderr
    # --force rewrites the workflow for your suite, which it keeps (it dropped your edit).
    forced = harness(root, "init", *WORKFLOWS, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (root / "suites" / "cpu.json").read_text() == edited
    assert "timeout-minutes: 55" in (root / ".github/workflows/harness-cpu.yml").read_text()
    # Deleted, it is written anew from pytest's configuration.
    (root / "suites" / "cpu.json").unlink()
    assert harness(root, "init").returncode == 0
    assert manifest(root, "cpu.json")["runner"]["timeout_minutes"] == 30
    # A manifest that is not UTF-8 is refused as any other content (it was a traceback).
    (root / "suites" / "cpu.json").write_bytes(b'{"suite": "cpu", \xff}')
    broken = harness(root, "init")
    assert broken.returncode == 2, broken.stderr
    assert "suites/cpu.json exists with other content" in broken.stderr


def test_workflows_for_a_folder_of_a_git_repository_are_refused(tmp_path):
    # Regression: in a monorepo's project folder, --workflows wrote
    # python/.github/workflows/harness-cpu.yml, which GitHub never reads, without a word.
    top = tmp_path / "mono"
    root = write(
        top / "python",
        {
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
            "tests/test_plain.py": "def test_plain():\n    pass\n",
        },
    )
    subprocess.run(["git", "init", "-q", str(top)], check=True)
    # Told without git itself (a first version asked git, and wrote when git was missing).
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run(
        [sys.executable, "-m", "harness", "init", *WORKFLOWS],
        cwd=root, capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"is a folder of the git repository {top}" in done.stderr
    assert "working-directory: python" in done.stderr
    assert not (root / ".github").exists()
    assert not (root / "suites").exists()
    done = harness(root, "init")
    assert done.returncode == 0, done.stderr
    assert (root / "suites/cpu.json").is_file()


def test_accelerator_suites_share_one_case_list_and_get_workflows(tmp_path):
    root = write(
        tmp_path,
        {
            "pyproject.toml": '[project]\nname = "demo"\nversion = "0"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
            "tests/test_plain.py": "def test_plain():\n    pass\n",
            "tests/test_ranks.py": LAUNCHED_DEVICE_TEST,
        },
    )
    done = harness(root, "init", "--accelerators", "gpu,npu", *WORKFLOWS)
    assert done.returncode == 0, done.stderr
    shared = manifest(root, "cases/accelerator.json")
    assert [e["paths"] for e in shared["entries"]] == [["tests"]]
    for suite, device in (("gpu", "cuda"), ("npu", "npu")):
        doc = manifest(root, f"{suite}.json")
        assert doc["device"] == device
        assert doc["entries"] == [{"include": "suites/cases/accelerator.json"}]
        assert doc["runner"]["cards"] == 2  # the launched case's ranks, one card each
    inv = harness(root, "inventory", "--json")
    assert inv.returncode == 0, inv.stdout + inv.stderr
    owners = {c["nodeid"]: c["entries"] for c in json.loads(inv.stdout)["cases"]}
    assert owners["tests/test_ranks.py::test_world[cuda]"] == ["gpu:tests"]
    assert owners["tests/test_ranks.py::test_world[npu]"] == ["npu:tests"]
    assert owners["tests/test_plain.py::test_plain"] == ["cpu:tests"]

    workflows = root / ".github" / "workflows"
    assert sorted(p.name for p in workflows.iterdir()) == [
        "harness-cpu.yml",
        "harness-gpu.yml",
        "harness-npu.yml",
    ]
    gpu = yaml.safe_load((workflows / "harness-gpu.yml").read_text())
    assert gpu["jobs"]["suite"]["if"].startswith("needs.plan.outputs.trusted == 'true' && ")
    assert "head.repo.full_name == github.repository" in gpu["jobs"]["plan"]["outputs"]["trusted"]

    # The case list you add cases to is kept, --force or not (--force overwrote it); a suite
    # you moved to another device is not the one asked for: refused (it was kept, exit 0).
    cases = root / "suites/cases/accelerator.json"
    mine = json.loads(cases.read_text())
    mine["entries"].append({"id": "more", "paths": ["tests/test_plain.py"]})
    cases.write_text(json.dumps(mine, indent=2))
    again = harness(root, "init", "--accelerators", "gpu,npu", *WORKFLOWS, "--force")
    assert again.returncode == 0, again.stderr
    assert "suites/cases/accelerator.json exists with other content: kept" in again.stderr
    assert json.loads(cases.read_text()) == mine
    gpu_json = root / "suites/gpu.json"
    gpu_json.write_text(gpu_json.read_text().replace('"device": "cuda"', '"device": "npu"'))
    moved = harness(root, "init", "--accelerators", "gpu,npu")
    assert moved.returncode == 2, moved.stderr
    assert "suites/gpu.json exists with other content" in moved.stderr


def test_usage_errors_exit_2(tmp_path):
    root = write(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"})
    done = harness(root, "init", "--accelerators", "tpu")
    assert done.returncode == 2
    assert "unknown accelerator 'tpu'" in done.stderr
    assert not (root / "suites").exists()


def test_a_project_without_tests_is_told_so(tmp_path):
    (tmp_path / "README.md").write_text("nothing to test\n")
    done = harness(tmp_path, "init")
    assert done.returncode == 1
    assert "collects no test file" in done.stderr
    assert not (tmp_path / "suites").exists()


def test_written_cpu_workflow_caches_and_outlasts_the_harness_deadline(tmp_path):
    root = write(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"})
    assert harness(root, "init", *WORKFLOWS).returncode == 0
    doc = yaml.safe_load((root / ".github" / "workflows" / "harness-cpu.yml").read_text())
    assert doc["concurrency"]["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"
    job = doc["jobs"]["cpu"]
    assert job["timeout-minutes"] > manifest(root, "cpu.json")["runner"]["timeout_minutes"]
    setup = next(
        s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")
    )
    assert setup["with"]["cache"] == "pip"


def test_writes_only_entries_the_inventory_accepts(tmp_path):
    # No testpaths: one entry per test directory. tests/unit holds only cpu cases, so an
    # accelerator suite entry owning it would match nothing; tests/gone skips as a whole
    # here, which says nothing of the device its cases run on: the cpu suite owns it.
    root = write(
        tmp_path,
        {
            "pyproject.toml": "[tool.pytest.ini_options]\n",
            "tests/unit/test_u.py": "def test_u():\n    pass\n",
            "tests/dev/test_d.py": LAUNCHED_DEVICE_TEST,
            "tests/gone/test_g.py": "import pytest\n\npytest.importorskip('module_that_does_not_exist')\n",
        },
    )
    done = harness(root, "init", "--accelerators", "cuda,npu")
    assert done.returncode == 0, done.stderr
    assert [e["paths"] for e in manifest(root, "cases/accelerator.json")["entries"]] == [
        ["tests/dev"],
    ]
    assert "1 test file(s) did not load here (tests/gone/test_g.py)" in done.stderr
    assert [e["paths"] for e in manifest(root, "cpu.json")["entries"]] == [
        ["tests/dev"],
        ["tests/gone"],
        ["tests/unit"],
    ]
    inv = harness(root, "inventory")
    assert inv.returncode == 0, inv.stdout + inv.stderr


def test_no_accelerator_case_writes_no_accelerator_suite(tmp_path):
    root = write(
        tmp_path,
        {
            "pyproject.toml": "[tool.pytest.ini_options]\n",
            "tests/test_u.py": "def test_u():\n    pass\n",
        },
    )
    done = harness(root, "init", "--accelerators", "cuda")
    assert done.returncode == 0, done.stderr
    assert "no collected case runs on cuda" in done.stderr
    assert sorted(p.name for p in (root / "suites").iterdir()) == ["cpu.json"]
    assert harness(root, "inventory").returncode == 0


def test_a_file_that_fails_to_import_here_gets_no_accelerator_entry(tmp_path):
    # Regression (issue 43): init --accelerators on a CPU machine wrote accelerator entries
    # for the folders whose files failed to import there; `harness matrix gpu` then planned
    # cases that were no GPU cases at all.
    root = write(
        tmp_path,
        {
            "pyproject.toml": "[tool.pytest.ini_options]\n",
            "tests/unit/test_u.py": "def test_u():\n    pass\n",
            "tests/gpu/test_kernel.py": "import module_only_on_gpu_hosts\n\ndef test_k():\n    pass\n",
            "tests/dev/test_d.py": LAUNCHED_DEVICE_TEST,
        },
    )
    done = harness(root, "init", "--accelerators", "cuda")
    assert done.returncode == 0, done.stderr
    assert [e["paths"] for e in manifest(root, "cases/accelerator.json")["entries"]] == [
        ["tests/dev"]
    ]
    assert manifest(root, "gpu.json")["entries"] == [{"include": "suites/cases/accelerator.json"}]
    assert ["tests/gpu"] in [e["paths"] for e in manifest(root, "cpu.json")["entries"]]
    assert "did not load here (tests/gpu/test_kernel.py)" in done.stderr
    assert "--device-paths" in done.stderr

    # Only a file: no accelerator suite at all.
    (root / "tests/dev/test_d.py").unlink()
    for p in (root / "suites").rglob("*.json"):
        p.unlink()
    done = harness(root, "init", "--accelerators", "cuda")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (root / "suites").glob("*.json")) == ["cpu.json"]


def test_device_paths_make_plain_tests_accelerator_cases_without_editing_them(tmp_path):
    root = write(
        tmp_path,
        {
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
            "tests/unit/test_u.py": "def test_u():\n    pass\n",
            # Picks its device at run time, as a training framework's tests do.
            "tests/gpu/test_g.py": "def test_g():\n    pass\n",
        },
    )
    done = harness(root, "init", "--accelerators", "cuda", "--device-paths", "tests/gpu")
    assert done.returncode == 0, done.stderr
    assert manifest(root, "gpu.json")["entries"] == [
        {"id": "tests-gpu-cuda", "paths": ["tests/gpu"], "device": "cuda"}
    ]
    assert not (root / "suites/cases/accelerator.json").exists()
    inv = harness(root, "inventory", "gpu", "--json")
    assert inv.returncode == 0, inv.stdout + inv.stderr
    assert [(c["nodeid"], c["device"], c["cards"]) for c in json.loads(inv.stdout)["cases"]] == [
        ("tests/gpu/test_g.py::test_g", "cuda", 1)
    ]
    assert harness(root, "inventory").returncode == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--device-paths", "tests"), "say which with --accelerators"),
        (("--accelerators", "cuda", "--device-paths", "nowhere"), "'nowhere' does not exist"),
        (("--accelerators", "cuda", "--device-paths", "../x"), "not a path inside"),
    ],
)
def test_bad_device_paths_are_usage_errors(tmp_path, args, words):
    root = write(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"})
    done = harness(root, "init", *args)
    assert done.returncode == 2
    assert words in done.stderr
    assert not (root / "suites").exists()


def test_init_without_accelerators_names_the_accelerator_cases_it_leaves_unowned(tmp_path):
    # Regression: init wrote cpu.json only and said "next: harness inventory", which then
    # failed with unowned-case for every cuda and npu variant, with no word from init.
    root = write(
        tmp_path,
        {
            "pyproject.toml": "[tool.pytest.ini_options]\n",
            "tests/dev/test_d.py": LAUNCHED_DEVICE_TEST,
        },
    )
    done = harness(root, "init")
    assert done.returncode == 0, done.stderr
    assert "collected cases run on cuda, npu, which no suite owns" in done.stderr
    assert "--accelerators cuda,npu" in done.stderr
    again = harness(root, "init", "--accelerators", "cuda,npu", "--force")
    assert again.returncode == 0, again.stderr
    assert "which no suite owns" not in again.stderr
    assert harness(root, "inventory").returncode == 0
    # Regression: a later plain init said so again though gpu.json and npu.json own them,
    # and its --workflows wrote cpu's workflow only.
    later = harness(root, "init", *WORKFLOWS)
    assert later.returncode == 0, later.stderr
    assert "which no suite owns" not in later.stderr
    assert {p.name for p in (root / ".github/workflows").iterdir()} == {
        "harness-cpu.yml",
        "harness-gpu.yml",
        "harness-npu.yml",
    }


def test_init_in_a_subfolder_of_a_configured_project_refuses_and_names_the_root(tmp_path):
    # Regression: run in tests/ it wrote tests/suites/cpu.json (owning "test_a.py"), which
    # `harness inventory` at the root never found.
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_a.py").write_text("def test_a():\n    pass\n")
    done = harness(tmp_path / "tests", "init")
    assert done.returncode == 2, done.stdout + done.stderr  # a usage error
    assert f"inside the project that {tmp_path / 'pyproject.toml'} configures" in done.stderr
    assert f"--root {tmp_path}" in done.stderr
    assert not (tmp_path / "tests/suites").exists()
    # The way out it names works as written.
    assert harness(tmp_path / "tests", "init", "--root", str(tmp_path)).returncode == 0
    assert (tmp_path / "suites/cpu.json").exists()
    (tmp_path / "suites/cpu.json").unlink()
    done = harness(tmp_path, "init")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "suites/cpu.json").exists()


@pytest.mark.parametrize(
    ("files", "where", "refused"),
    [
        # pytest 9 reads pytest.toml first: a subproject with its own is a project.
        (
            {"pyproject.toml": "[tool.pytest.ini_options]\n", "sub/pytest.toml": "[pytest]\n"},
            "sub",
            False,
        ),
        # ... and a pytest.toml above a subfolder configures it.
        ({"pytest.toml": "[pytest]\n"}, "sub", True),
        # Another tool's table named like pytest's is no pytest configuration.
        ({"pyproject.toml": "[tool.pytest_env]\nX = '1'\n"}, "sub", False),
    ],
)
def test_init_reads_pytest_configuration_files_as_pytest_does(tmp_path, files, where, refused):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / where / "tests").mkdir(parents=True)
    (tmp_path / where / "tests/test_a.py").write_text("def test_a():\n    pass\n")
    done = harness(tmp_path / where, "init")
    assert done.returncode == (2 if refused else 0), done.stdout + done.stderr
    assert ("inside the project that" in done.stderr) == refused, done.stderr
    assert (tmp_path / where / "suites/cpu.json").exists() != refused


def test_ignores_the_run_output_and_points_schema_only_at_what_exists(tmp_path):
    # Regression: init left out/ (where `harness run` writes) out of .gitignore, and the
    # manifests of a repository outside the harness's own pointed $schema at a URL that
    # serves nothing.
    root = write(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n", ".gitignore": "*.pyc"})
    done = harness(root, "init")
    assert done.returncode == 0, done.stderr
    assert (root / ".gitignore").read_text() == "*.pyc\nout/\n"
    assert "appended" in done.stdout
    assert "$schema" not in manifest(root, "cpu.json")  # the installed schema is outside root
    again = harness(root, "init")
    assert again.returncode == 0, again.stderr
    assert (root / ".gitignore").read_text() == "*.pyc\nout/\n"  # once
    # Only .gitignore is appended to: a workflow you cut short (its gate job deleted) is
    # yours, refused without --force like any other edit.
    assert harness(root, "init", *WORKFLOWS).returncode == 0
    workflow = root / ".github/workflows/harness-cpu.yml"
    workflow.write_text(workflow.read_text().split("\n  gate:")[0])
    refused = harness(root, "init", *WORKFLOWS)
    assert refused.returncode == 2, refused.stderr
    assert "harness-cpu.yml exists with other content" in refused.stderr
    (tmp_path / "fresh").mkdir()
    fresh = write(tmp_path / "fresh", {"tests/test_a.py": "def test_a():\n    pass\n"})
    assert harness(fresh, "init").returncode == 0
    assert (fresh / ".gitignore").read_text() == "out/\n"


def test_help_names_the_working_directory_as_the_root(tmp_path):
    # Regression: `harness init --help` gave --root the other commands' default (the nearest
    # folder above with suites/), though init starts where it is run.
    done = harness(tmp_path, "init", "--help")
    assert done.returncode == 0
    assert "--harness-ref" in done.stdout
    root_help = " ".join(done.stdout.rsplit("--root ROOT", 1)[1].split())
    assert root_help.startswith("repository root (default: the working directory)"), root_help
