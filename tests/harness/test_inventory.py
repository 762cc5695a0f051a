"""Inventory rules, each on a small pytester project collected in-process."""

from __future__ import annotations

import json
import textwrap

import pytest
from suite_project import DEVICE_TESTS, GPU_RUNNER, make_project, manifest

from harness.suites.cli import main
from harness.suites.inventory import build_inventory

SHARED = {"entries": [{"id": "dev", "paths": ["tests"]}]}
ACCEL = {
    "gpu": manifest("gpu", "cuda", [{"include": "suites/cases/acc.json"}]),
    "npu": manifest("npu", "npu", [{"include": "suites/cases/acc.json"}]),
}


def project(pytester, tests=None, cpu_entries=None, **suites):
    docs = {
        "cpu": manifest("cpu", "cpu", cpu_entries or [{"id": "all", "paths": ["tests"]}]),
        **ACCEL,
        **suites,
    }
    return make_project(
        pytester.path,
        tests or {"tests/test_a.py": DEVICE_TESTS},
        {k: v for k, v in docs.items() if v is not None},
        {"suites/cases/acc.json": SHARED},
    )


def rules(inv):
    return sorted({p.rule for p in inv.problems})


def only(inv, rule):
    found = [p for p in inv.problems if p.rule == rule]
    assert found, [str(p) for p in inv.problems]
    return found


def test_clean_project_each_device_variant_in_its_suite(pytester):
    inv = build_inventory(project(pytester))
    assert inv.problems == []
    owners = {n: sorted(o) for n, o in inv.owners.items()}
    assert owners == {
        "tests/test_a.py::test_plain": [("cpu", "all")],
        "tests/test_a.py::test_dev[cpu]": [("cpu", "all")],
        "tests/test_a.py::test_dev[cuda]": [("gpu", "dev")],
        "tests/test_a.py::test_dev[npu]": [("npu", "dev")],
    }
    cases = {c["nodeid"]: c for c in inv.as_dict()["cases"]}
    assert cases["tests/test_a.py::test_dev[cuda]"] == {
        "nodeid": "tests/test_a.py::test_dev[cuda]",
        "device": "cuda",
        "nproc": 1,
        "cards": 1,
        "nnodes": 1,
        "launched": False,
        "entries": ["gpu:dev"],
    }


def test_launched_cases_take_the_device_of_their_spec(pytester):
    tests = {
        "tests/test_l.py": """
        import pytest
        from harness.spec import LaunchSpec

        @pytest.mark.launch(nproc=2)
        def test_gloo():
            pass

        @pytest.mark.launch(LaunchSpec(device="cuda", nproc=2))
        def test_nccl():
            pass

        @pytest.mark.launch(LaunchSpec(device="npu", nproc=2))
        def test_hccl():
            pass
    """
    }
    inv = build_inventory(project(pytester, tests))
    assert inv.problems == []
    got = {c.nodeid.split("::")[1]: (c.device, c.nproc, c.cards, c.launched) for c in inv.cases}
    assert got == {
        "test_gloo": ("cpu", 2, 0, True),
        "test_nccl": ("cuda", 2, 2, True),
        "test_hccl": ("npu", 2, 2, True),
    }
    assert inv.owners["tests/test_l.py::test_nccl"] == [("gpu", "dev")]


def test_rule_cpu_case_needs_cards(pytester):
    inv = build_inventory(
        project(
            pytester,
            cpu_entries=[
                {"id": "all", "paths": ["tests"]},
                {"id": "bad", "paths": ["tests/test_a.py::test_dev[cuda]"]},
            ],
        )
    )
    (p,) = only(inv, "cpu-case-needs-cards")
    assert p.file == "suites/cpu.json"
    assert p.where.startswith("tests/test_a.py::test_dev[cuda] (entry 'bad'")
    assert "asks for 1 card(s)" in p.message


def test_rule_accelerator_case_without_cards(pytester):
    gpu = manifest(
        "gpu",
        "cuda",
        [
            {"include": "suites/cases/acc.json"},
            {"id": "plain", "paths": ["tests/test_a.py::test_plain"]},
        ],
    )
    inv = build_inventory(project(pytester, gpu=gpu))
    (p,) = only(inv, "accelerator-case-without-cards")
    assert p.file == "suites/gpu.json"
    assert "tests/test_a.py::test_plain" in p.where
    assert rules(inv) == ["accelerator-case-without-cards"]


def test_rule_case_exceeds_runner_cards(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_big.py": """
        import pytest

        @pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
        @pytest.mark.launch(nproc=4)
        def test_four(device):
            pass
    """,
    }
    inv = build_inventory(project(pytester, tests))
    found = only(inv, "case-exceeds-runner-cards")
    assert {p.suite for p in found} == {"gpu", "npu"}
    assert all(
        "test_four[" in p.where and "needs 4 card(s)" in p.message and "has 2" in p.message
        for p in found
    )


MULTI_NODE_TESTS = {
    "tests/test_n.py": """
    import pytest

    @pytest.mark.launch(nnodes=2, nproc=2)
    def test_two_nodes():
        pass
"""
}


def test_rule_case_exceeds_runner_nodes(pytester):
    inv = build_inventory(project(pytester, MULTI_NODE_TESTS, gpu=None, npu=None))
    (p,) = only(inv, "case-exceeds-runner-nodes")
    assert p.suite == "cpu"
    assert "tests/test_n.py::test_two_nodes" in p.where
    assert "needs 2 nodes" in p.message
    assert "at most 1" in p.message
    assert rules(inv) == ["case-exceeds-runner-nodes"]
    assert [c["nnodes"] for c in inv.as_dict()["cases"]] == [2]


def test_a_runner_with_the_nodes_takes_a_multi_node_case(pytester):
    from suite_project import CPU_RUNNER

    cpu = manifest("cpu", "cpu", [{"id": "all", "paths": ["tests"]}], {**CPU_RUNNER, "nodes": 2})
    inv = build_inventory(project(pytester, MULTI_NODE_TESTS, cpu=cpu, gpu=None, npu=None))
    assert inv.problems == []


def test_rule_unowned_file(pytester):
    tests = {"tests/test_a.py": DEVICE_TESTS, "tests/new/test_b.py": "def test_b():\n    pass\n"}
    inv = build_inventory(
        project(pytester, tests, cpu_entries=[{"id": "a", "paths": ["tests/test_a.py"]}])
    )
    (p,) = only(inv, "unowned-file")
    assert str(p).startswith("tests/new/test_b.py: [unowned-file]")
    assert rules(inv) == ["unowned-file"]  # its cases are not reported once more


def test_file_collecting_nothing_is_owned_by_its_entry_path(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_opt.py": """
        import pytest
        pytest.importorskip("module_that_is_not_installed")

        def test_x():
            pass
    """,
    }
    assert build_inventory(project(pytester, tests)).problems == []


def test_rule_unowned_case_excluded_by_markers(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_m.py": """
        import pytest

        def test_fast():
            pass

        @pytest.mark.slow
        def test_slow():
            pass
    """,
    }
    inv = build_inventory(
        project(
            pytester,
            tests,
            cpu_entries=[
                {"id": "all", "paths": ["tests/test_a.py"]},
                {"id": "fast", "paths": ["tests/test_m.py"], "markers": "not slow"},
            ],
        )
    )
    (p,) = only(inv, "unowned-case")
    assert p.where == "tests/test_m.py::test_slow"
    # It names the manifest to edit: the suites on the case's device.
    assert p.message == (
        "cpu case owned by no suite entry: add its file or node id to an entry of suites/cpu.json"
    )
    assert rules(inv) == ["unowned-case"]


def test_rule_entry_matches_nothing(pytester):
    inv = build_inventory(
        project(
            pytester,
            cpu_entries=[
                {"id": "all", "paths": ["tests"]},
                {"id": "ghost", "paths": ["tests/gone"]},
                {"id": "shadowed", "paths": ["tests/test_a.py"]},
            ],
        )
    )
    found = {p.where.split()[0]: p for p in only(inv, "entry-matches-nothing")}
    assert set(found) == {"/entries/1", "/entries/2"}
    assert "match no cpu case" in found["/entries/1"].message
    assert "owned by the earlier entry 'all'" in found["/entries/2"].message
    assert all(p.file == "suites/cpu.json" for p in found.values())


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("scripts/tset_x.py", "no such file or folder"),
        ("tests/sub/test_b.py::tset_b", "no collected case"),  # the file is there
        ("tests/sbu/*.py", "no collected case"),
        ("./tests/sub", "no collected case"),  # exists, but entries match paths as written
    ],
)
def test_a_misspelled_path_next_to_good_ones_is_reported(pytester, path, why):
    # Regression: an entry {"paths": ["tests/test_a.py", "scripts/tset_x.py"]} owned cases
    # through its first path, so nothing named the typo: scripts/test_x.py (outside
    # testpaths) never ran, and a case under tests/ ran under the catch-all entry's settings.
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/sub/test_b.py": "def test_b():\n    pass\n",
        "scripts/test_x.py": "def test_x():\n    pass\n",
    }
    entries = [
        {"id": "e", "paths": ["tests/test_a.py", path, "tests/*.py"], "timeout_s": 30},
        {"id": "rest", "paths": ["tests", "scripts"]},
    ]
    inv = build_inventory(project(pytester, tests, cpu_entries=entries))
    found = only(inv, "entry-matches-nothing")
    assert len(found) == 1, [(p.where, p.message) for p in found]
    (p,) = found
    assert p.where == "/entries/0/paths/1 (entry 'e')"
    assert p.message == f"suite 'cpu': its path {path!r} matches nothing: {why}"
    assert p.file == "suites/cpu.json"


def test_accelerator_entry_matching_only_cpu_tests_matches_nothing(pytester):
    tests = {"tests/test_a.py": DEVICE_TESTS, "tests/plain/test_p.py": "def test_p():\n    pass\n"}
    gpu = manifest(
        "gpu",
        "cuda",
        [{"include": "suites/cases/acc.json"}, {"id": "plain", "paths": ["tests/plain"]}],
    )
    inv = build_inventory(project(pytester, tests, gpu=gpu))
    (p,) = only(inv, "entry-matches-nothing")
    assert p.suite == "gpu"
    assert "match no cuda case" in p.message


def test_rule_duplicate_entry_id(pytester):
    inv = build_inventory(
        project(
            pytester,
            cpu_entries=[
                {"id": "all", "paths": ["tests/test_a.py::test_plain"]},
                {"id": "all", "paths": ["tests"]},
            ],
        )
    )
    (p,) = only(inv, "duplicate-entry-id")
    assert str(p).startswith("suites/cpu.json /entries/1/id: [duplicate-entry-id]")


def test_rule_schema_error_in_inventory(pytester):
    cpu = manifest("cpu", "cpu", [{"id": "all", "paths": ["tests"], "timeout_s": -5}])
    inv = build_inventory(project(pytester, cpu=cpu))
    (p,) = only(inv, "schema")
    assert str(p).startswith("suites/cpu.json /entries/0/timeout_s: [schema]")
    # With a manifest broken, ownership is not judged (it would only be noise).
    assert "unowned-file" not in rules(inv)
    assert "unowned-case" not in rules(inv)


def test_rule_manifest_not_json(pytester):
    inv = build_inventory(project(pytester, cpu='{"suite": "cpu",\n  oops}'))
    (p,) = only(inv, "json")
    assert p.file == "suites/cpu.json:2:3"


def test_rule_collection_error(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_broken.py": "from os import name_that_os_lacks\n",
    }
    inv = build_inventory(project(pytester, tests))
    (p,) = only(inv, "collection-error")
    assert p.file == "tests/test_broken.py"
    assert "name_that_os_lacks" in p.message


def test_a_module_of_the_repository_that_does_not_import_stays_an_error(pytester):
    # Regression: under --import-mode=importlib a test's own folder is not importable, and
    # `import helpers_here` (tests/helpers_here.py) was "not installed", a warning no
    # install mends.
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/helpers_here.py": "X = 1\n",
        "tests/deep/test_h.py": "import helpers_here\n",
        # A test folder named like the library it tests is no module of that name.
        "tests/nosuchlib/test_t.py": "import nosuchlib\n",
    }
    root = project(pytester, tests)
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "--import-mode=importlib"\n'
    )
    inv = build_inventory(root)
    got = sorted((p.rule, p.file, p.message) for p in inv.problems)
    assert got[0] == (
        "collection-error",
        "tests/deep/test_h.py",
        "ModuleNotFoundError: No module named 'helpers_here'",
    ), got
    assert [(r, f) for r, f, _ in got[1:]] == [("missing-dependency", "tests/nosuchlib/test_t.py")]


@pytest.mark.parametrize("addopts", ["-p no:xdist", "-n 2"])
def test_a_project_that_configures_xdist_itself_is_collected(pytester, addopts):
    # Regression: collection added -n 0 whenever xdist was installed, and a project whose
    # addopts switch xdist off got "unrecognized arguments: -n" from harness init,
    # inventory and run. xdist starts no workers under --collect-only anyway.
    root = project(pytester, {"tests/test_a.py": DEVICE_TESTS})
    (root / "pyproject.toml").write_text(
        f'[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "{addopts}"\n'
    )
    inv = build_inventory(root)
    assert [p.message for p in inv.problems] == []
    assert len(inv.suite_cases("cpu")) == 2  # test_plain, test_dev[cpu]


def test_rule_missing_dependency_is_a_warning_grouped_by_module(pytester, capsys):
    # Regression: in an environment without the tests' dependencies (a lint job with only
    # the harness installed), every test file importing one was a collection-error, and
    # `harness inventory` failed with one error per file, ownership unjudged.
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/deps/test_one.py": "import absent_distribution_one\n",
        "tests/deps/test_two.py": "from absent_distribution_one.sub import thing\n",
        "tests/deps/test_three.py": "import json\nimport absent_distribution_two\n",
        # Absent submodules of what is there stay errors: a bug, not the environment.
        "tests/local/helpers_pkg/__init__.py": "",
        "tests/local/test_local.py": "import helpers_pkg.not_there\n",
        "tests/local/test_stdlib.py": "import json.not_there\n",
        # ... and so does a sibling that a helper (the file that raised) imports so.
        "tests/local/lib/__init__.py": "",
        "tests/local/lib/helper.py": "import utils_sib\n",
        "tests/local/lib/utils_sib.py": "",
        "tests/local/test_lib.py": "from lib import helper\n",
    }
    entries = [
        {"id": "a", "paths": ["tests/test_a.py"]},
        {"id": "deps", "paths": ["tests/deps"]},
        {"id": "local", "paths": ["tests/local"]},
    ]
    root = project(pytester, tests, entries)
    inv = build_inventory(root)
    assert rules(inv) == ["collection-error", "missing-dependency"], [str(p) for p in inv.problems]
    errors = sorted((p.file, p.message) for p in only(inv, "collection-error"))
    assert errors == [
        ("tests/local/test_lib.py", "ModuleNotFoundError: No module named 'utils_sib'"),
        (
            "tests/local/test_local.py",
            "ModuleNotFoundError: No module named 'helpers_pkg.not_there'",
        ),
        ("tests/local/test_stdlib.py", "ModuleNotFoundError: No module named 'json.not_there'"),
    ]
    one, two = only(inv, "missing-dependency")
    assert one.file == "tests/deps/test_one.py"
    assert one.message.startswith("module 'absent_distribution_one' is not installed for ")
    assert "2 test file(s) import it" in one.message
    assert "tests/deps/test_one.py, tests/deps/test_two.py." in one.message
    assert two.file == "tests/deps/test_three.py"
    assert "module 'absent_distribution_two'" in two.message
    # The files are owned by their entry, which is not idle.
    assert {"tests/deps/test_one.py", "tests/deps/test_two.py"} <= set(inv.unloadable)

    for f in ("test_local.py", "test_stdlib.py", "test_lib.py"):
        (root / "tests/local" / f).write_text("def test_fixed():\n    pass\n")
    assert main(["--root", str(root), "inventory", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err.count("warning: ") == 2, err
    assert "error: " not in err, err
    assert "[missing-dependency] module 'absent_distribution_one'" in err
    assert "0 problem(s), 2 warning(s)" in out
    # --json keeps them apart from the errors (a CI step failing on "errors" stays green).
    assert main(["--root", str(root), "inventory", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"] == []
    assert [w["rule"] for w in doc["warnings"]] == ["missing-dependency"] * 2


def test_a_session_wide_collection_failure_is_reported_alone(pytester, monkeypatch):
    # Regression: a usage error stops pytest's whole session (here a bad simulated card
    # inventory); the inventory named it, then called every entry entry-matches-nothing.
    root = project(pytester)
    monkeypatch.setenv("HARNESS_CARDS", "gpu0")
    inv = build_inventory(root)
    assert rules(inv) == ["collection-error"], [str(p) for p in inv.problems]
    (p,) = inv.problems
    assert p.message.startswith("pytest exited with 4"), p.message
    assert "HARNESS_CARDS" in p.message, p.message


def test_an_unusable_lease_folder_does_not_stop_the_inventory(pytester, monkeypatch, tmp_path):
    # Regression: the launch plugin refused an unusable lease folder in every session,
    # collect-only ones too: `harness inventory` / `matrix` failed, leasing nothing.
    root = project(pytester)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HARNESS_LEASE_DIR", str(tmp_path / "file" / "leases"))
    inv = build_inventory(root)
    assert inv.problems == [], [str(p) for p in inv.problems]


def test_rule_bad_launch_spec(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_bad.py": """
        import pytest

        @pytest.mark.launch(nproc=0)
        def test_zero():
            pass
    """,
    }
    inv = build_inventory(project(pytester, tests))
    (p,) = only(inv, "bad-launch-spec")
    assert p.where == "tests/test_bad.py::test_zero"
    assert "nproc" in p.message
    # Regression: a file an entry owns whose only case has a bad marker was also "unowned".
    assert [str(p) for p in inv.problems if p.rule == "unowned-file"] == []


def test_first_matching_entry_owns_and_markers_select(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_m.py": """
        import pytest

        @pytest.mark.slow
        def test_slow():
            pass

        def test_fast():
            pass
    """,
    }
    inv = build_inventory(
        project(
            pytester,
            tests,
            cpu_entries=[
                {"id": "slow", "paths": ["tests"], "markers": "slow"},
                {"id": "rest", "paths": ["tests"]},
            ],
        )
    )
    assert inv.problems == []
    assert inv.owners["tests/test_m.py::test_slow"] == [("cpu", "slow")]
    assert inv.owners["tests/test_m.py::test_fast"] == [("cpu", "rest")]


def test_cli_inventory_json_and_exit_codes(pytester, capsys):
    project(
        pytester,
        {"tests/test_a.py": DEVICE_TESTS, "tests/x/test_b.py": "def test_b():\n    pass\n"},
        cpu_entries=[{"id": "a", "paths": ["tests/test_a.py"]}],
    )
    assert main(["--root", str(pytester.path), "inventory", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"cases", "errors", "warnings"}
    assert {c["nodeid"] for c in doc["cases"]} >= {
        "tests/test_a.py::test_dev[npu]",
        "tests/x/test_b.py::test_b",
    }
    assert [e["rule"] for e in doc["errors"]] == ["unowned-file"]

    # Naming a suite lists its cases only; ownership is still judged against all suites.
    assert main(["--root", str(pytester.path), "inventory", "gpu", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["nodeid"] for c in doc["cases"]] == ["tests/test_a.py::test_dev[cuda]"]

    (pytester.path / "suites/cpu.json").write_text(
        json.dumps(manifest("cpu", "cpu", [{"id": "a", "paths": ["tests"]}]))
    )
    assert main(["--root", str(pytester.path), "inventory", "--cases"]) == 0
    out = capsys.readouterr().out
    assert "tests/test_a.py::test_dev[npu]" in out
    assert "npu:dev" in out
    assert "5 case(s); per suite: cpu 3, gpu 1, npu 1; 0 problem(s)" in out


def test_cli_inventory_text_names_rule_file_and_case(pytester, capsys):
    project(
        pytester,
        cpu_entries=[
            {"id": "all", "paths": ["tests"]},
            {"id": "x", "paths": ["tests/test_a.py::test_dev[npu]"]},
        ],
    )
    assert main(["--root", str(pytester.path), "inventory", "-q"]) == 1
    err = capsys.readouterr().err
    assert "suites/cpu.json tests/test_a.py::test_dev[npu] (entry 'x'" in err
    assert "[cpu-case-needs-cards]" in err


@pytest.mark.parametrize("name", ["tpu", "suites/tpu.json"])
def test_cli_unknown_suite(pytester, capsys, name):
    project(pytester)
    assert main(["--root", str(pytester.path), "inventory", name]) == 1
    assert "[unknown-suite]" in capsys.readouterr().err


def test_broken_other_manifest_does_not_flood_a_named_inventory(pytester):
    project(
        pytester, cpu=manifest("cpu", "cpu", [{"id": "all", "paths": ["tests"], "timeout_s": 0}])
    )
    inv = build_inventory(pytester.path, ["gpu"])
    assert inv.problems == []  # cpu's problem is cpu's; ownership is not judged without cpu
    assert [c.nodeid for c, _ in inv.suite_cases("gpu")] == ["tests/test_a.py::test_dev[cuda]"]


# --------------------------------------------------------------------------- pytest's own collection rules


def test_ownership_follows_pytests_collection_rules(pytester):
    # Which files are tests is pytest's call (python_files, testpaths,
    # norecursedirs, --ignore from the configuration), not a hard-coded tests/**/test_*.py.
    config = """
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        python_files = ["check_*.py"]
        norecursedirs = ["fixtures"]
        addopts = ["--ignore=tests/skipme"]
    """
    tests = {
        "tests/check_owned.py": "def test_a():\n    pass\n",
        "tests/check_new.py": "def test_b():\n    pass\n",
        "tests/fixtures/test_data.py": "def test_not_collected():\n    pass\n",
        "tests/skipme/test_x.py": "def test_ignored():\n    pass\n",
        "scripts/test_tool.py": "def test_outside_testpaths():\n    pass\n",
    }
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", [{"id": "owned", "paths": ["tests/check_owned.py"]}])},
        {"pyproject.toml": textwrap.dedent(config)},
    )
    inv = build_inventory(root)
    assert [str(p) for p in inv.problems] == [
        "tests/check_new.py: [unowned-file] test file owned by no suite entry: add it to a suite in suites/"
    ]
    assert [c.nodeid for c in inv.cases] == [
        "tests/check_new.py::test_b",
        "tests/check_owned.py::test_a",
    ]


def test_entry_outside_testpaths_is_still_collected(pytester):
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "scripts/check_tool.py": "def test_tool():\n    pass\n",
    }
    inv = build_inventory(
        project(
            pytester,
            tests,
            cpu_entries=[
                {"id": "all", "paths": ["tests"]},
                {"id": "tool", "paths": ["scripts/check_tool.py"]},
            ],
        )
    )
    assert inv.problems == []
    assert inv.owners["scripts/check_tool.py::test_tool"] == [("cpu", "tool")]


@pytest.mark.parametrize("with_dir", [False, True])
def test_repository_without_suites_is_an_error(pytester, capsys, with_dir):
    # Never "0 case(s), 0 problem(s)" and exit 0.
    marker = pytester.path / "imported"
    pytester.makepyfile(
        test_a="def test_a():\n    pass\n",
        test_b=f"open({str(marker)!r}, 'w').close()\n",
    )
    if with_dir:
        (pytester.path / "suites").mkdir()
    assert main(["--root", str(pytester.path), "inventory"]) == 1
    err = capsys.readouterr().err
    assert "suites/: [no-suites]" in err
    assert ("has no suite manifests" if with_dir else "does not exist in") in err
    assert str(pytester.path) in err  # the root it picked
    # Nothing was collected (outside a repository, everything below the working directory
    # was, before the inventory said there was no suite).
    assert not marker.exists()
    assert err.count("error: ") == 1, err


# --------------------------------------------------------------------------- diagnostics


def test_symlink_leaving_the_repository_is_named_as_such(pytester, tmp_path_factory):
    # It was "[unowned-file] ... add it to a suite" although tests/ is owned.
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "test_far.py"
    elsewhere.write_text("def test_far():\n    pass\n")
    root = project(pytester)
    (root / "tests/test_link.py").symlink_to(elsewhere)
    inv = build_inventory(root)
    (p,) = inv.problems
    assert p.rule == "symlink-outside-repository"
    assert p.file == "tests/test_link.py"
    assert f"is a symlink to {elsewhere.resolve()}, outside the repository" in p.message
    assert inv.owners["tests/test_link.py::test_far"] == [("cpu", "all")]


@pytest.mark.parametrize(
    ("source", "where", "message"),
    [
        ("import os\n\ndef test_x(:\n    pass\n", "line 3", "SyntaxError: invalid syntax"),
        (
            "import os\nimport json.module_that_does_not_exist\n",
            "line 2",
            "ModuleNotFoundError: No module named 'json.module_that_does_not_exist'",
        ),
        (
            "import helper_that_raises\n",
            "line 1, raised at tests/helper_that_raises.py:2",
            "ValueError: boom",
        ),
    ],
)
def test_collection_error_keeps_file_and_line(pytester, source, where, message):
    # Only the last line ("E   SyntaxError: invalid syntax") was kept.
    tests = {
        "tests/test_a.py": DEVICE_TESTS,
        "tests/test_broken.py": source,
        "tests/helper_that_raises.py": "def f():\n    raise ValueError('boom')\n\nf()\n",
    }
    inv = build_inventory(project(pytester, tests))
    (p,) = only(inv, "collection-error")
    assert (p.file, p.where, p.message) == ("tests/test_broken.py", where, message)
    assert str(p) == f"tests/test_broken.py {where}: [collection-error] {message}"


def test_glob_entries_collect_what_they_match_for_a_run(pytester):
    # Without the ownership check (what `harness run` does) only entry paths are
    # collected: each glob is expanded, in one walk, to the files it matches.
    tests = {
        "tests/a/test_one.py": "def test_1():\n    pass\n",
        "tests/b/c/test_two.py": "def test_2():\n    pass\n",
        "tests/b/c/check_three.py": "def test_3():\n    pass\n",
        "tests/.hidden/test_no.py": "def test_x():\n    pass\n",
    }
    root = project(
        pytester,
        tests,
        cpu_entries=[
            {"id": "one", "paths": ["tests/*/test_*.py"]},
            {"id": "deep", "paths": ["tests/**/c/*_*.py"]},
        ],
    )
    inv = build_inventory(root, ["cpu"], check_ownership=False)
    assert inv.problems == []
    assert {c.nodeid: o for c in inv.cases for o in inv.owners[c.nodeid]} == {
        "tests/a/test_one.py::test_1": ("cpu", "one"),
        "tests/b/c/test_two.py::test_2": ("cpu", "deep"),
        "tests/b/c/check_three.py::test_3": ("cpu", "deep"),
    }


def test_tests_hidden_by_norecursedirs_inside_testpaths_are_a_warning(pytester, capsys):
    root = project(
        pytester,
        {
            "tests/test_a.py": DEVICE_TESTS,
            "tests/dist/test_hidden.py": "def test_h():\n    pass\n",
            "tests/build/helper.py": "",
            "tests/.cache/test_x.py": "",
        },
    )
    inv = build_inventory(root)
    (p,) = only(inv, "tests-under-norecursedirs")
    assert p.file == "tests/dist/test_hidden.py"
    assert "norecursedirs pattern 'dist'" in p.message
    assert rules(inv) == ["tests-under-norecursedirs"]
    # A warning: the inventory passes, and run / matrix do not see it.
    assert main(["--root", str(root), "inventory"]) == 0
    out, err = capsys.readouterr()
    assert "warning: tests/dist/test_hidden.py: [tests-under-norecursedirs]" in err
    assert out.strip().endswith("0 problem(s), 1 warning(s)")
    assert main(["--root", str(root), "matrix", "cpu"]) == 0
    # Named by an entry, it is collected by name and owned: no warning.
    doc = manifest(
        "cpu",
        "cpu",
        [{"id": "a", "paths": ["tests/test_a.py"]}, {"id": "dist", "paths": ["tests/dist"]}],
    )
    (root / "suites/cpu.json").write_text(json.dumps(doc))
    inv = build_inventory(root)
    assert inv.problems == []
    assert inv.owners["tests/dist/test_hidden.py::test_h"] == [("cpu", "dist")]


def test_only_the_blocking_rules_stop_run_and_matrix():
    from harness import names

    assert not names.BLOCKING_RULES & (names.WARNING_RULES | names.OWNERSHIP_RULES)


def test_default_output_is_one_line_per_entry(pytester, capsys):
    root = project(pytester)
    assert main(["--root", str(root), "inventory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ENTRY", "CASES", "DEVICES", "NPROC", "CARDS"]
    assert out[1].split() == ["cpu:all", "2", "cpu", "1", "0"]
    assert sorted(line.split()[0] for line in out[1:-1]) == ["cpu:all", "gpu:dev", "npu:dev"]
    assert main(["--root", str(root), "inventory", "--cases"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["CASE", "DEVICE"]
    assert len(out) == 1 + 4 + 1  # header, every case, the count line


def test_pytest_failing_before_its_session_is_a_problem_not_a_traceback(pytester, capsys):
    # Regression: a configuration warning made an error (filterwarnings = error) escaped
    # pytest.main as an exception: `harness inventory` / `init` ended in a traceback.
    root = project(pytester)
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["not_here"]\nfilterwarnings = ["error"]\n'
    )
    assert main(["--root", str(root), "inventory"]) == 1
    err = capsys.readouterr().err
    assert "[collection-error] pytest exited with 3" in err, err
    assert "PytestConfigWarning: No files were found in testpaths" in err, err
    assert "entry-matches-nothing" not in err, err


def test_sys_exit_in_a_conftest_is_a_problem_not_a_silent_exit(pytester, capsys):
    # Regression: SystemExit from a conftest pytest loads before its session escaped
    # pytest.main: `harness inventory` exited with the conftest's code and said nothing.
    root = project(pytester)
    (root / "conftest.py").write_text("import sys\n\nsys.exit(3)\n")
    assert main(["--root", str(root), "inventory"]) == 1
    err = capsys.readouterr().err
    assert "[collection-error] pytest exited with 3" in err, err
    assert "SystemExit(3) while pytest loaded the project" in err, err


def test_pytest_exit_during_collection_is_a_problem_not_an_interrupt(pytester, capsys):
    # Regression: pytest.exit in a conftest hook was taken for Ctrl-C: `harness inventory`
    # said "interrupted" and exited 130, and so did `harness run`.
    root = project(pytester)
    (root / "conftest.py").write_text(
        "import pytest\n\ndef pytest_collection_finish(session):\n"
        "    pytest.exit('cut short', returncode=0)\n"
    )
    assert main(["--root", str(root), "inventory"]) == 1
    err = capsys.readouterr().err
    assert "[collection-error] pytest.exit during collection (Exit: cut short)" in err, err


# --------------------------------------------------------------------------- entry device


RUNTIME_DEVICE_TESTS = """
    import pytest
    from harness.spec import LaunchSpec

    def test_picks_device_at_run_time():
        pass

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_dev(device):
        pass

    @pytest.mark.launch(LaunchSpec(device="cpu", nproc=2))
    def test_launched():
        pass
"""


def device_project(pytester, entry, runner=None):
    gpu = manifest("gpu", "cuda", [{"id": "plain", "paths": ["tests"], **entry}], runner)
    return make_project(
        pytester.path,
        {"tests/test_r.py": RUNTIME_DEVICE_TESTS},
        {"cpu": manifest("cpu", "cpu", [{"id": "all", "paths": ["tests"]}]), "gpu": gpu},
    )


def test_plain_case_of_a_cuda_entry_is_a_cuda_case_with_the_entrys_cards(pytester, capsys):
    root = device_project(pytester, {"device": "cuda", "cards": 2})
    inv = build_inventory(root)
    assert inv.problems == []
    plain = "tests/test_r.py::test_picks_device_at_run_time"
    # The case that says its device keeps it: its cuda variant is the gpu entry's as before,
    # its cpu variant and the launched cpu case stay the cpu suite's.
    assert {n: sorted(o) for n, o in inv.owners.items()} == {
        plain: [("cpu", "all"), ("gpu", "plain")],
        "tests/test_r.py::test_dev[cpu]": [("cpu", "all")],
        "tests/test_r.py::test_dev[cuda]": [("gpu", "plain")],
        "tests/test_r.py::test_launched": [("cpu", "all")],
    }
    assert [(c.nodeid, c.device, c.cards) for c, _ in inv.suite_cases("gpu")] == [
        (plain, "cuda", 2),
        ("tests/test_r.py::test_dev[cuda]", "cuda", 1),
    ]
    assert next((c.nodeid, c.device, c.cards) for c, _ in inv.suite_cases("cpu")) == (
        plain,
        "cpu",
        0,
    )
    assert main(["--root", str(root), "inventory", "gpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["cases"]
    assert rows == [
        {
            "nodeid": plain,
            "device": "cuda",
            "nproc": 1,
            "cards": 2,
            "nnodes": 1,
            "launched": False,
            "entries": ["gpu:plain"],
        },
        {
            "nodeid": "tests/test_r.py::test_dev[cuda]",
            "device": "cuda",
            "nproc": 1,
            "cards": 1,
            "nnodes": 1,
            "launched": False,
            "entries": ["gpu:plain"],
        },
    ]
    # Unfiltered, the plain case is listed once per way it runs.
    assert main(["--root", str(root), "inventory", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["cases"]
    assert [(r["device"], r["cards"], r["entries"]) for r in rows if r["nodeid"] == plain] == [
        ("cpu", 0, ["cpu:all"]),
        ("cuda", 2, ["gpu:plain"]),
    ]


def test_without_an_entry_device_a_plain_case_is_no_gpu_case(pytester):
    # Regression: the gpu suite owned nothing of a suite whose tests pick the device at run time.
    inv = build_inventory(device_project(pytester, {}))
    assert [c.nodeid for c, _ in inv.suite_cases("gpu")] == ["tests/test_r.py::test_dev[cuda]"]


def test_entry_cards_beyond_the_runner_are_named(pytester):
    inv = build_inventory(device_project(pytester, {"device": "cuda", "cards": 4}))
    (p,) = only(inv, "case-exceeds-runner-cards")
    assert p.where.startswith("tests/test_r.py::test_picks_device_at_run_time (entry 'plain'")
    assert "needs 4 card(s)" in p.message


def test_matrix_plans_plain_cases_of_a_cuda_entry_on_runners_with_their_cards(pytester, capsys):
    runners = [
        {**GPU_RUNNER, "name": "one", "cards": 1},
        {**GPU_RUNNER, "name": "four", "cards": 4},
    ]
    root = device_project(pytester, {"device": "cuda", "cards": 3}, runners)
    assert main(["--root", str(root), "matrix", "gpu", "--shards", "2"]) == 0
    shards = json.loads(capsys.readouterr().out)["include"]
    placed = {s["runner_name"]: s["cases"] for s in shards}
    assert placed["four"] == 1  # the 3-card plain case fits only the 4-card runner
    assert sum(placed.values()) == 2
