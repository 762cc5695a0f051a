"""The launch plugin end to end: one real pytest session runs every outcome
scenario in real rank processes; each test below checks one scenario's report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from launch_project import inner_env, read_pids, run_session, survivors, write_project

OUTCOMES = """
    import os
    import signal
    import threading
    import time

    import pytest

    import harness
    from harness import LaunchSpec
    from recording import out_dir, record_pid


    def add(a, b):
        import torch.distributed as dist

        return dist.get_rank(), a + b


    @pytest.fixture
    def payload():
        return {"numbers": [1, 2, 3]}


    @pytest.fixture
    def lock():
        return threading.Lock()


    @pytest.mark.launch(nproc=2)
    def test_pass():
        import json

        import torch
        import torch.distributed as dist

        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        env = {name: os.environ[name] for name in names}
        env["backend"] = dist.get_backend()
        gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        env["pg_timeout_s"] = gloo.options._timeout.total_seconds()
        from harness.launcher.rank import EnclosingCase

        env["left_s"] = EnclosingCase.from_env().deadline - time.time()
        (out_dir() / f"env-{dist.get_rank()}.json").write_text(json.dumps(env))
        record_pid(f"pass-rank-{dist.get_rank()}")
        print(f"hello from rank {dist.get_rank()}")


    @pytest.mark.launch(nproc=2)
    def test_rank_fails():
        import torch.distributed as dist

        rank = dist.get_rank()
        assert rank == 0
        dist.barrier()


    @pytest.mark.launch(nproc=2)
    def test_rank_sigkilled():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()


    @pytest.mark.launch(nproc=2)
    def test_rank_exits():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()


    @pytest.mark.launch(nproc=2)
    def test_skip_in_ranks():
        pytest.skip("no frobnicator on this host")


    @pytest.mark.parametrize("value", [7, "text"])
    @pytest.mark.launch(nproc=2)
    def test_params(value, payload, tmp_path):
        rank = os.environ["RANK"]
        assert payload == {"numbers": [1, 2, 3]}
        (out_dir() / f"param-{value}-{rank}.txt").write_text(f"{value!r} {tmp_path.name}")


    @pytest.mark.launch(nproc=1)
    def test_unpicklable_fixture(lock):
        pass


    @pytest.mark.launch(nproc=1)
    def test_nested_launch():
        assert harness.launch(add, LaunchSpec(nproc=1), 2, 3) == [(0, 5)]
        harness.launch(add, LaunchSpec(nproc=2), 2, 3)


    class TestInAClass:
        @pytest.mark.launch(nproc=1)
        def test_method(self):
            assert isinstance(self, TestInAClass)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = write_project(tmp_path_factory.mktemp("outcomes"), {"test_outcomes.py": OUTCOMES})
    env = inner_env(root / "out", root / "leases")
    return root, run_session(root, env=env)


def test_passing_case_runs_every_rank_with_its_environment(outcomes):
    import json

    root, session = outcomes
    assert session.case("test_pass").status == "passed", session.output
    for rank in (0, 1):
        env = json.loads((root / "out" / f"env-{rank}.json").read_text())
        # A stuck collective must raise in the rank before the 300 s case deadline
        # (which starts when the ranks are ready, just after they join): the
        # group's timeout is the deadline less a margin.
        timeout, left = env.pop("pg_timeout_s"), env.pop("left_s")
        assert timeout <= 270.0
        assert timeout < left
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "backend": "gloo",
        }


def test_no_rank_survives_its_case(outcomes):
    root, _ = outcomes
    pids = read_pids(root / "out")
    assert {"pass-rank-0", "pass-rank-1"} <= set(pids)
    assert survivors(list(pids.values()), wait=0) == []


def test_failing_rank_is_named_with_its_traceback_first(outcomes):
    _, session = outcomes
    case = session.case("test_rank_fails")
    assert case.status == "failed"
    assert case.text.startswith("rank 1 failed: AssertionError: assert 1 == 0"), case.text
    assert 'test_outcomes.py", line ' in case.text
    assert "in test_rank_fails\n    assert rank == 0" in case.text
    # The peer's consequent error is summarised after the first failure.
    first, _, others = case.text.partition("other ranks:")
    assert "rank 0 failed:" in others
    assert "rank 0" not in first.splitlines()[0]


@pytest.mark.parametrize(
    ("test", "death"),
    [
        (
            "test_rank_sigkilled",
            "rank 1 was killed by signal SIGKILL (9) before reporting an outcome",
        ),
        ("test_rank_exits", "rank 1 exited with code 3 before reporting an outcome"),
    ],
)
def test_rank_that_dies_is_named_with_its_signal_or_exit_code(outcomes, test, death):
    _, session = outcomes
    case = session.case(test)
    assert case.status == "failed"
    assert case.text.startswith(death), case.text


def test_skip_inside_ranks_skips_the_case_with_its_reason(outcomes):
    _, session = outcomes
    case = session.case("test_skip_in_ranks")
    assert case.status == "skipped"
    assert case.message == "no frobnicator on this host"


def test_parametrized_arguments_and_fixture_values_reach_every_rank(outcomes):
    root, session = outcomes
    for value in ("7", "text"):
        assert session.case(f"test_params[{value}]").status == "passed", session.output
    written = {p.name: p.read_text() for p in (root / "out").glob("param-*.txt")}
    assert set(written) == {
        "param-7-0.txt",
        "param-7-1.txt",
        "param-text-0.txt",
        "param-text-1.txt",
    }
    assert written["param-text-1.txt"].startswith("'text' test_params_text_")


def test_unpicklable_fixture_fails_naming_the_fixture(outcomes):
    _, session = outcomes
    case = session.case("test_unpicklable_fixture")
    assert case.status == "failed"
    assert "fixture 'lock'" in case.text
    assert "cannot be sent to the rank processes" in case.text


def test_launching_more_ranks_than_declared_fails_giving_both_numbers(outcomes):
    _, session = outcomes
    case = session.case("test_nested_launch")
    assert case.status == "failed"
    # The first, in-budget nested launch returned; the second asked for too many.
    assert "harness.launch would start 2 ranks" in case.text
    assert "declares nproc=1" in case.text


def test_test_methods_run_in_ranks(outcomes):
    _, session = outcomes
    assert session.case("test_method").status == "passed", session.output


def test_rank_output_is_reported_per_rank(outcomes):
    _, session = outcomes
    assert "----- rank 0 output -----\nhello from rank 0" in session.output
    assert "----- rank 1 output -----\nhello from rank 1" in session.output


DEVICE_TESTS = """
    import os

    import pytest

    from harness import DEVICES, LaunchSpec


    @pytest.mark.parametrize("device", DEVICES)
    def test_each_device(device):
        if device != "cpu":
            assert os.environ["HARNESS_CARD"] == f"{device}:0"


    @pytest.mark.launch(LaunchSpec(device="cuda", nproc=2, backend="gloo"))
    def test_two_cuda_cards():
        pass


    @pytest.mark.skip(reason="skipped by its author")
    @pytest.mark.parametrize("device", ["npu"])
    def test_skipped_anyway(device):
        pass
"""


@pytest.fixture
def device_project(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0")
    monkeypatch.setenv("HARNESS_LEASE_DIR", str(tmp_path / "leases"))
    pytester.makepyfile(test_devices_inner=DEVICE_TESTS)
    return pytester


def test_devices_skip_missing_accelerators_with_a_reason(device_project):
    result = device_project.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "harness: cards cuda:0; npu: none (from HARNESS_CARDS); * process slots; lease dir *",
            "SKIPPED [[]1[]] test_devices_inner.py:*: needs 1 npu card; this host has none",
            "SKIPPED [[]1[]] test_devices_inner.py:*: needs 2 cuda cards; this host has 1 (cuda:0)",
        ]
    )


@pytest.mark.parametrize(
    ("require", "test", "reason"),
    [
        (
            "npu",
            "test_each_device[[]npu[]]",
            "needs 1 npu card; this host has none, and --harness-require npu is set (`harness run` sets it*",
        ),
        (
            "cuda,npu",
            "test_two_cuda_cards",
            "needs 2 cuda cards; this host has 1 (cuda:0), and --harness-require cuda is set (`harness run` sets it*",
        ),
    ],
    ids=["npu", "cuda"],
)
def test_required_devices_fail_instead_of_skipping(device_project, require, test, reason):
    result = device_project.runpytest_subprocess(
        f"--harness-require={require}", "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*ERROR at setup of {test}*", reason])
    # A test its author skipped stays skipped.
    result.stdout.fnmatch_lines(["*skipped*"])
    assert "test_skipped_anyway" not in result.stdout.str()


def test_unknown_required_device_is_a_usage_error(device_project):
    result = device_project.runpytest_subprocess("--harness-require=tpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--harness-require: unknown device(s) tpu*"])


def test_the_plugin_defines_the_option_names_harness_run_uses(tmp_path):
    """Regression: the plugin spelled ``--harness-require`` and ``--harness-max-procs``
    itself, so renaming ``names.OPT_REQUIRE`` / ``OPT_MAX_PROCS`` (which ``harness run``
    passes and reads) left the plugin on the old names: every accelerator run a usage
    error, a ``--harness-max-procs`` the run no longer saw."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    script = textwrap.dedent(
        """
        import sys

        from harness import names

        names.OPT_REQUIRE, names.OPT_MAX_PROCS = "--harness-needs", "--harness-slots"
        import pytest

        sys.exit(pytest.main(sys.argv[1:]))
        """
    )
    env = {**os.environ, "HARNESS_CARDS": "none", "HARNESS_LEASE_DIR": str(tmp_path / "leases")}
    env.pop("PYTEST_ADDOPTS", None)

    def session(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", script, "-p", "no:cacheprovider", "--co", "-q", *args]
        return subprocess.run(
            [*argv, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
        )

    done = session("--harness-needs=cuda", "--harness-slots=2")
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    for option, value in (("--harness-needs", "tpu"), ("--harness-slots", "0")):
        done = session(f"{option}={value}")
        assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
        assert f"{option}" in done.stderr


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
@pytest.mark.parametrize("option", ["--harness-timeout", "--harness-lease-timeout"])
def test_a_timeout_option_that_is_not_a_positive_finite_number_is_a_usage_error(
    tmp_path, option, value
):
    root = write_project(
        tmp_path / "project", {"test_nothing.py": "def test_nothing():\n    pass\n"}
    )
    session = run_session(root, f"{option}={value}", env=inner_env(root / "out", root / "leases"))
    assert session.returncode == pytest.ExitCode.USAGE_ERROR, session.output
    assert (
        f"{option} must be a positive, finite number of seconds; got {float(value)}"
        in session.output
    )
