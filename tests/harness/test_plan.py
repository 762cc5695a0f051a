"""The shard planner (balance, card constraints, budgets, durations) and change selection.

Balance is measured as the longest shard's planned seconds over the mean
shard's (``Plan.balance()``), on synthetic durations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.suites.changes import changed_files, select
from harness.suites.manifest import Entry, Runner
from harness.suites.plan import (
    PlanError,
    PlannedCase,
    estimate,
    load_durations,
    parse_shard,
    partition,
    plan,
    write_durations,
)


def runner(cards=0, timeout=60, budget=None, name=None):
    return Runner(
        ("lbl", f"c{cards}"),
        cards,
        timeout,
        budget if budget is not None else timeout * 0.75,
        name or f"r{cards}",
    )


def cases(seconds, cards=0):
    return [PlannedCase(f"tests/test_x.py::test_{i}", "e", cards, s) for i, s in enumerate(seconds)]


def lognormal(n, seed):
    rng = random.Random(seed)
    return [round(rng.lognormvariate(1.0, 1.0), 3) for _ in range(n)]


# --------------------------------------------------------------------------- balance


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shards", [2, 3, 4, 6, 8])
def test_lpt_balance_within_ten_percent_of_mean(seed, shards):
    # 400 heavy-tailed cases: the longest case is far below a shard's mean,
    # which is when the target "longest shard <= 1.1 x mean" is reachable.
    result = plan("s", [runner()], cases(lognormal(400, seed)), shards=shards, enforce_budget=False)
    assert len(result.shards) == shards
    assert result.balance() <= 1.1, [round(s.load, 1) for s in result.shards]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.floats(0.01, 500.0), min_size=1, max_size=60), st.integers(1, 8))
def test_longest_shard_within_mean_plus_longest_case(seconds, shards):
    """Greedy placement's bound: when the longest shard got its last case it was the
    least loaded, so longest <= mean + longest case; every case is placed exactly once."""
    result = partition(cases(seconds), [runner()], shards)
    loads = [s.load for s in result]
    assert max(loads) <= sum(seconds) / shards + max(seconds) + 1e-6
    placed = sorted(c.nodeid for s in result for c in s.cases)
    assert placed == sorted(c.nodeid for c in cases(seconds))


def test_one_dominant_case_gets_a_shard_of_its_own():
    result = plan("s", [runner()], cases([100, 10, 10, 10, 10, 10]), shards=2, enforce_budget=False)
    assert sorted(s.load for s in result.shards) == [50, 100]


def test_partition_is_deterministic_and_order_independent():
    cs = cases(lognormal(50, 1) + [3.0] * 10)
    shuffled = cs[:]
    random.Random(7).shuffle(shuffled)
    a = partition(cs, [runner()], 4)
    b = partition(shuffled, [runner()], 4)
    assert [[c.nodeid for c in s.cases] for s in a] == [[c.nodeid for c in s.cases] for s in b]


# --------------------------------------------------------------------------- cards


def test_cases_never_land_on_runners_with_fewer_cards():
    small, big = runner(1, name="one"), runner(4, name="four")
    cs = cases(lognormal(60, 2), cards=1) + [
        PlannedCase(f"tests/test_y.py::test_{i}", "e", 4, 20.0) for i in range(6)
    ]
    for n in (2, 3, 5):
        result = plan("s", [big, small], cs, shards=n, enforce_budget=False)
        assert {s.runner.name for s in result.shards} == {"one", "four"}
        for s in result.shards:
            assert all(c.cards <= s.runner.cards for c in s.cases)


def test_small_cases_fill_big_runners_when_one_shard():
    result = plan(
        "s",
        [runner(1), runner(4)],
        [*cases([5.0], cards=1), *cases([5.0], cards=4)[:0], PlannedCase("t::big", "e", 4, 5.0)],
        shards=1,
        enforce_budget=False,
    )
    (only,) = result.shards
    assert only.runner.cards == 4
    assert len(only.cases) == 2


def test_case_needing_more_cards_than_any_runner_is_refused():
    with pytest.raises(PlanError, match="needs 8 card"):
        partition([PlannedCase("t::huge", "e", 8, 1.0)], [runner(2)], 1)


# --------------------------------------------------------------------------- budgets and targets


def test_shards_over_budget_are_planned_as_asked_and_named():
    # Regression: --shards N over the runner's budget refused the count the caller asked for.
    result = plan("s", [runner(timeout=4, budget=3)], cases([100.0] * 6), shards=2)
    assert [len(s.cases) for s in result.shards] == [3, 3]
    (warning,) = result.warnings
    assert re.search(r"shard 1/2 is planned at 5.0 min, over the 3.0-min budget", warning)
    assert "shard 2/2" in warning
    assert plan("s", [runner(timeout=4, budget=3)], cases([100.0] * 6), shards=6).warnings == []


def test_single_case_over_budget_is_named():
    with pytest.raises(
        PlanError, match=r"test_0 is expected to take 5.0 min, over the shard budget of 3.0 min"
    ):
        plan("s", [runner(timeout=4, budget=3)], cases([300.0]))


def test_target_minutes_picks_the_fewest_shards_that_fit():
    result = plan("s", [runner()], cases([30.0] * 40), target_minutes=5)  # 20 min of work
    assert len(result.shards) == 4
    assert all(s.load <= 300 for s in result.shards)


def test_default_plan_fills_the_runner_budget():
    result = plan("s", [runner(timeout=20, budget=10)], cases([60.0] * 25))  # 25 min of work
    assert len(result.shards) == 3
    assert all(s.load <= 600 for s in result.shards)


def test_target_longer_than_one_case_is_refused():
    with pytest.raises(PlanError, match="over --target-minutes 1"):
        plan("s", [runner()], cases([120.0]), target_minutes=1)


def test_empty_suite_still_has_one_shard():
    m = plan("s", [runner()], []).matrix()
    assert m == {
        "include": [
            {
                "suite": "s",
                "shard": "1/1",
                "runner": ["lbl", "c0"],
                "runner_name": "r0",
                "cards": 0,
                "nodes": 1,
                "timeout_minutes": 60,
                "job_timeout_minutes": 70,
                "cases": 0,
                "estimated_minutes": 0.0,
            }
        ]
    }


def test_matrix_json_lists_every_shard():
    m = plan("gpu", [runner(2, timeout=30)], cases([60.0] * 10, cards=1), shards=3).matrix()
    assert [x["shard"] for x in m["include"]] == ["1/3", "2/3", "3/3"]
    assert all(
        x["runner"] == ["lbl", "c2"] and x["cards"] == 2 and x["timeout_minutes"] == 30
        for x in m["include"]
    )
    assert sum(x["cases"] for x in m["include"]) == 10
    json.dumps(m)


def test_multi_node_cases_go_to_runners_with_the_nodes_and_the_matrix_says_so():
    two = dataclasses.replace(runner(name="two-nodes"), nodes=2)
    wide = PlannedCase("tests/test_x.py::test_wide", "e", 0, 30.0, nodes=2)
    shards = partition([*cases([30.0, 30.0]), wide], [runner(), two], 2)
    by_runner = {s.runner.name: [c.nodeid for c in s.cases] for s in shards}
    assert "tests/test_x.py::test_wide" in by_runner["two-nodes"]
    rows = plan("s", [runner(), two], [*cases([30.0]), wide], shards=2).matrix()["include"]
    assert sorted((r["runner_name"], r["nodes"]) for r in rows) == [("r0", 1), ("two-nodes", 2)]
    with pytest.raises(PlanError, match="2 node"):
        partition([wide], [runner()], 1)


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/2/3"])
def test_parse_shard_rejects(bad):
    with pytest.raises(PlanError):
        parse_shard(bad)


# --------------------------------------------------------------------------- durations


def test_estimate_prefers_recorded_then_entry_median_then_estimate():
    raw = [
        ("a::1", "A", 0, 9.0),
        ("a::2", "A", 0, 9.0),
        ("a::3", "A", 0, 9.0),
        ("b::1", "B", 0, 7.0),
    ]
    got = {c.nodeid: (c.seconds, c.basis) for c in estimate(raw, {"a::1": 1.0, "a::2": 3.0})}
    assert got == {
        "a::1": (1.0, "recorded"),
        "a::2": (3.0, "recorded"),
        "a::3": (2.0, "entry-median"),
        "b::1": (7.0, "estimated"),
    }


def test_durations_round_trip_and_merge(tmp_path):
    path = tmp_path / "d" / "gpu.json"
    write_durations(path, "gpu", {"a::1": 1.23456, "b::2": 2.0})
    write_durations(path, "gpu", {"b::2": 4.0})
    assert load_durations(path) == {"a::1": 1.235, "b::2": 4.0}
    assert json.loads(path.read_text())["suite"] == "gpu"
    assert load_durations(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    "text",
    [
        "{",
        '{"durations": {"a": -1}}',
        '{"durations": ["a"]}',
        "[]",
        '{"durations": {"a": Infinity}}',
        '{"durations": {"a": NaN}}',
        '{"durations": {"a": 1%s}}' % ("0" * 400),  # regression: an OverflowError
    ],
)
def test_malformed_durations_name_the_file(tmp_path, text):
    path = tmp_path / "gpu.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=r"gpu\.json"):
        load_durations(path)


# --------------------------------------------------------------------------- change selection


def entry(eid, paths, depends_on=None):
    return Entry(
        eid,
        tuple(paths),
        None,
        None,
        5.0,
        tuple(depends_on) if depends_on is not None else None,
        "suites/cpu.json",
        "/entries/0",
    )


ENTRIES = [
    entry("ops", ["tests/ops"], ["channel_loss/ops.py"]),
    entry("meter", ["tests/meter"], ["channel_loss/meter.py", "channel_loss/layout.py"]),
    entry("always", ["tests/misc"]),
]


@pytest.mark.parametrize(
    ("changed", "chosen", "everything"),
    [
        (["channel_loss/ops.py"], {"ops", "always"}, False),
        (["tests/meter/test_m.py"], {"meter", "always"}, False),  # its own test files count
        (["README.md"], {"always"}, False),
        ([], {"always"}, False),
        (["harness/plan.py"], {"always"}, False),  # a vendored harness: its depends_on say
        (["suites/gpu.json"], {"ops", "meter", "always"}, True),
        # Regression: a lockfile, a requirements list or a CI workflow changed alone
        # selected only the entries without depends_on.
        (["uv.lock"], {"ops", "meter", "always"}, True),
        (["poetry.lock"], {"ops", "meter", "always"}, True),
        (["requirements-dev.txt"], {"ops", "meter", "always"}, True),
        (["ci/requirements.txt"], {"ops", "meter", "always"}, True),
        (["Pipfile.lock"], {"ops", "meter", "always"}, True),
        (["pdm.lock"], {"ops", "meter", "always"}, True),
        ([".github/workflows/ci.yml"], {"ops", "meter", "always"}, True),
        (["pytest.ini"], {"ops", "meter", "always"}, True),
        (["conftest.py"], {"ops", "meter", "always"}, True),
        (["pyproject.toml"], {"ops", "meter", "always"}, True),
        (["noxfile.py"], {"ops", "meter", "always"}, True),
        (["tests/conftest.py"], {"ops", "meter", "always"}, True),
        (None, {"ops", "meter", "always"}, True),  # git could not tell
    ],
)
def test_select(changed, chosen, everything):
    sel = select(ENTRIES, changed)
    assert set(sel.entries) == chosen
    assert sel.everything is everything


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    for f in ("channel_loss/ops.py", "channel_loss/meter.py", "tests/ops/test_o.py", "README.md"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "base")
    git(tmp_path, "checkout", "-q", "-b", "feature")
    return tmp_path


def test_changed_files_from_a_real_git_repo(repo):
    (repo / "channel_loss/ops.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "committed change")
    (repo / "README.md").write_text("y\n")  # unstaged
    (repo / "tests/new").mkdir()
    (repo / "tests/new/test_n.py").write_text("")  # untracked
    git(repo, "mv", "channel_loss/meter.py", "channel_loss/meter2.py")  # staged rename: both names
    got, why = changed_files(repo, "main")
    assert why == ""
    assert got == [
        "README.md",
        "channel_loss/meter.py",
        "channel_loss/meter2.py",
        "channel_loss/ops.py",
        "tests/new/test_n.py",
    ]
    sel = select(ENTRIES, got)
    assert set(sel.entries) == {"ops", "meter", "always"}
    assert not sel.everything


def test_changes_since_the_merge_base_only(repo):
    git(repo, "checkout", "-q", "main")
    (repo / "channel_loss/meter.py").write_text("main moved on\n")
    git(repo, "commit", "-qam", "main only")
    git(repo, "checkout", "-q", "feature")
    (repo / "channel_loss/ops.py").write_text("x = 3\n")
    assert changed_files(repo, "main") == (["channel_loss/ops.py"], "")


def test_a_lockfile_change_alone_in_git_runs_everything(repo):
    # Regression: a change to uv.lock alone selected only the entries without depends_on.
    (repo / "uv.lock").write_text("version = 1\n")
    git(repo, "add", "uv.lock")
    git(repo, "commit", "-qm", "lock")
    assert changed_files(repo, "main") == (["uv.lock"], "")
    sel = select(ENTRIES, *changed_files(repo, "main"))
    assert sel.everything
    assert set(sel.entries) == {"ops", "meter", "always"}
    assert sel.reason == "uv.lock changed: running every entry"


def test_run_everything_on_replaces_the_default_list():
    extended = ("uv.lock", "vendor/**")
    sel = select(ENTRIES, ["vendor/lib/x.py"], run_everything_on=extended)
    assert sel.everything
    sel = select(ENTRIES, ["vendor/lib/x.py"])  # the default names no vendor/
    assert set(sel.entries) == {"always"}
    # The manifest's list replaces the default: pyproject.toml is not in it.
    assert not select(ENTRIES, ["pyproject.toml"], run_everything_on=extended).everything
    assert not select(ENTRIES, ["uv.lock"], run_everything_on=()).everything


def test_unknown_ref_runs_everything_and_says_what_git_said(repo):
    # The reason was "changed files unknown", whatever git had said (a typo'd ref, say).
    files, why = changed_files(repo, "no-such-ref")
    assert files is None
    assert why.startswith("git merge-base: fatal: "), why
    assert "no-such-ref" in why, why
    sel = select(ENTRIES, files, why)
    assert sel.everything
    assert sel.reason == f"changed files unknown ({why}): running every entry"


# --------------------------------------------------------------------------- one planner


def test_the_shard_run_is_the_shard_planned(pytester, capsys):
    from suite_project import make_project, manifest

    from harness.suites.cli import main
    from harness.suites.inventory import build_inventory
    from harness.suites.plan import plan_suite
    from harness.suites.selection import plan_shard

    tests = {
        "tests/t/test_t.py": "import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_t(i):\n    pass\n"
    }
    seconds = [40, 5, 30, 10, 25, 15, 20]
    durations = {"durations": {f"tests/t/test_t.py::test_t[{i}]": s for i, s in enumerate(seconds)}}
    root = make_project(
        pytester.path,
        tests,
        {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])},
        {"suites/durations/cpu.json": durations},
    )
    inv = build_inventory(root, ["cpu"], check_ownership=False)
    m, owned = inv.manifests["cpu"], inv.suite_cases("cpu")
    for n in (1, 2, 3):
        assert main(["--root", str(root), "matrix", "cpu", "--shards", str(n)]) == 0
        matrix = json.loads(capsys.readouterr().out)["include"]
        planned = plan_suite(root, m, owned, shards=n)
        ran = [
            {c.nodeid for c, _ in plan_shard(root, m, owned, None, (i, n))[0]}
            for i in range(1, n + 1)
        ]
        assert ran == [{c.nodeid for c in s.cases} for s in planned.shards]
        assert [len(r) for r in ran] == [row["cases"] for row in matrix]
        assert set().union(*ran) == {c.nodeid for c, _ in owned}


def test_more_shards_than_cases_is_a_usage_error(pytester, capsys):
    from suite_project import make_project, manifest

    from harness.suites.cli import main

    tests = {"tests/t/test_t.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n"}
    root = make_project(
        pytester.path, tests, {"cpu": manifest("cpu", "cpu", [{"id": "t", "paths": ["tests/t"]}])}
    )
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "2"]) == 0
    capsys.readouterr()
    assert main(["--root", str(root), "matrix", "cpu", "--shards", "3000000"]) == 2
    assert "3000000 shards for suite 'cpu' of 2 case(s): at most 2" in capsys.readouterr().err
    assert main(["--root", str(root), "run", "cpu", "--shard", "1/3"]) == 2
    assert "3 shards for suite 'cpu' of 2 case(s): at most 2" in capsys.readouterr().err
    # (The run's own pytest planned it: it ran no case and wrote no summary.)
    assert not list(root.glob("out/**/summary.md"))


def test_suite_errors_derive_from_the_harness_error_base():
    from harness.errors import HarnessError
    from harness.suites.init import InitError
    from harness.suites.manifest import ManifestError

    assert issubclass(PlanError, HarnessError)
    assert issubclass(PlanError, ValueError)
    assert issubclass(ManifestError, HarnessError)
    assert issubclass(InitError, HarnessError)


# --------------------------------------------------------------------------- the JSON writer


def test_write_json_replaces_atomically_and_refuses_what_is_not_json(tmp_path):
    from harness.jsonio import write_json

    target = tmp_path / "deep/dir/doc.json"
    write_json(target, {"a": 1})
    write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    with pytest.raises(ValueError):
        write_json(target, {"a": float("nan")})
    assert json.loads(target.read_text()) == {"a": 2}  # the old file is whole
    with pytest.raises(TypeError):
        write_json(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["doc.json"]  # no temporary left
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open(path, "w") gives


def test_deeply_nested_durations_file_is_named(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"durations": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(PlanError, match=r"d\.json.*nested too deeply"):
        load_durations(path)
