"""A kept rank is indistinguishable from a fresh one for the next case: each
pair of cases below runs on one kept pool, the first leaving some process
state changed, the second checking it sees what a fresh rank would."""

from __future__ import annotations

import pytest
from launch_project import inner_env, run_session, write_project

PAIRS = """
    import io
    import json
    import os
    import signal
    import sys
    import time

    import pytest
    import torch
    from torch.overrides import TorchFunctionMode

    from recording import out_dir

    if "RANK" not in os.environ:  # collection, in the launcher: what a fresh rank inherits
        (out_dir() / "launcher.json").write_text(json.dumps({
            "affinity": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "tzname": list(time.tzname),
            "digits": sys.get_int_max_str_digits(),
        }))


    def launcher():
        return json.loads((out_dir() / "launcher.json").read_text())


    launch = pytest.mark.launch(nproc=1)


    @launch
    def test_monkeypatch_a(monkeypatch):
        monkeypatch.setattr(time, "harness_probe", 1, raising=False)


    @launch
    def test_monkeypatch_b():
        assert not hasattr(time, "harness_probe")


    @launch
    def test_flush_denormal_a():
        torch.set_flush_denormal(True)


    @launch
    def test_flush_denormal_b():
        assert torch.tensor([1e-40]).mul(1.0).item() != 0.0


    def refuse(tensor):
        raise RuntimeError("a saved-tensor hook of the previous case")


    @launch
    def test_saved_tensor_hooks_a():
        torch.autograd.graph.saved_tensors_hooks(refuse, refuse).__enter__()


    @launch
    def test_saved_tensor_hooks_b():
        x = torch.ones(2, requires_grad=True)
        (x * x).sum().backward()


    class Refuse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            raise RuntimeError("a torch function mode of the previous case")


    @launch
    def test_torch_function_mode_a():
        Refuse().__enter__()


    @launch
    def test_torch_function_mode_b():
        assert (torch.ones(2) + 1).tolist() == [2.0, 2.0]


    @launch
    def test_cpu_affinity_a():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


    @launch
    def test_cpu_affinity_b():
        assert sorted(os.sched_getaffinity(0)) == launcher()["affinity"]


    @launch
    def test_nice_a():
        os.nice(1)


    @launch
    def test_nice_b():
        assert os.getpriority(os.PRIO_PROCESS, 0) == launcher()["nice"]


    @launch
    def test_signal_mask_a():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})


    @launch
    def test_signal_mask_b():
        assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


    @launch
    def test_tz_a():
        os.environ["TZ"] = "Asia/Tokyo"
        time.tzset()


    @launch
    def test_tz_b():
        assert list(time.tzname) == launcher()["tzname"]


    @launch
    def test_int_digits_a():
        sys.set_int_max_str_digits(640)


    @launch
    def test_int_digits_b():
        assert sys.get_int_max_str_digits() == launcher()["digits"]


    @launch
    def test_stdin_a():
        sys.stdin = io.StringIO("left by the previous case")


    @launch
    def test_stdin_b():
        assert not isinstance(sys.stdin, io.StringIO)


    @launch
    def test_print_options_a():
        torch.set_printoptions(precision=1)


    @launch
    def test_print_options_b():
        assert str(torch.tensor([1.23456])) == "tensor([1.2346])"


    @pytest.fixture
    def two_threads(monkeypatch):
        monkeypatch.setenv("OMP_NUM_THREADS", "2")


    @launch
    def test_omp_num_threads_a():
        assert torch.get_num_threads() == 1


    @launch
    def test_omp_num_threads_b(two_threads):
        assert torch.get_num_threads() == 2
"""

FACTS = [
    "monkeypatch",
    "flush_denormal",
    "saved_tensor_hooks",
    "torch_function_mode",
    "cpu_affinity",
    "nice",
    "signal_mask",
    "tz",
    "int_digits",
    "stdin",
    "print_options",
    "omp_num_threads",
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = write_project(tmp_path_factory.mktemp("pairs"), {"test_pairs.py": PAIRS})
    return run_session(root, env=inner_env(root / "out", root / "leases"), timeout=400)


@pytest.mark.parametrize("fact", FACTS)
def test_next_case_on_a_kept_rank_sees_a_fresh_rank(pairs, fact):
    assert pairs.case(f"test_{fact}_a").status == "passed", pairs.case(f"test_{fact}_a").text
    second = pairs.case(f"test_{fact}_b")
    assert second.status == "passed", second.text
