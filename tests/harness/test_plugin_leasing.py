"""Cards are leased exclusively across xdist workers and across sessions.

The inventory is simulated (``HARNESS_CARDS``): ranks run on Gloo and record
which card they were given and when they used it. Process slots are made
plentiful (``--harness-max-procs 8``) so that only the card leases can be
what keeps the cases apart.
"""

from __future__ import annotations

import os
import subprocess

from launch_project import (
    assert_disjoint_per_card,
    inner_env,
    parse_junit,
    pytest_command,
    read_card_uses,
    run_session,
    write_project,
)

from harness.devices import Card
from harness.launcher.lease import acquire, card_want

# Collected in this order, `--dist load` hands the first two tests to gw0 and
# the last two to gw1: both 2-card cases start at once, on different workers.
CARD_CASES = """
    import os

    import pytest

    from harness import LaunchSpec
    from recording import record_card_use

    TWO_CARDS = LaunchSpec(device="cuda", nproc=2, backend="gloo")


    @pytest.mark.launch(TWO_CARDS)
    def test_two_cards_a():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HARNESS_CARD"].split(":")[1]
        record_card_use("a")


    @pytest.mark.parametrize("device", ["cuda"])
    def test_one_card_1(device):
        record_card_use("plain1", seconds=0.5)


    @pytest.mark.launch(TWO_CARDS)
    def test_two_cards_b():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HARNESS_CARD"].split(":")[1]
        record_card_use("b")


    @pytest.mark.parametrize("device", ["cuda"])
    def test_one_card_2(device):
        record_card_use("plain2", seconds=0.5)
"""


def test_xdist_workers_never_share_a_card(tmp_path):
    root = write_project(tmp_path / "project", {"test_cards.py": CARD_CASES})
    env = inner_env(root / "out", root / "leases", cards="cuda:0,1,2")
    # 2 + 2 of 3 cards cannot run at once: the leases are what keeps the 2-card cases apart.
    args = ["-n", "2", "--dist", "load", "--harness-max-procs", "8"]
    session = run_session(root, *args, env=env)
    assert session.returncode == 0, session.output
    uses = read_card_uses(root / "out")
    cases = {}
    for use in uses:
        cases.setdefault(use["case"], []).append(use)
    assert sorted(cases) == ["a", "b", "plain1", "plain2"]
    for name in ("a", "b"):
        assert len({u["card"] for u in cases[name]}) == 2, cases[name]  # a card per rank
    # The schedule really put the two 2-card cases on different workers...
    assert {u["worker"] for u in cases["a"]} != {u["worker"] for u in cases["b"]}
    # ...and with 2 + 2 cards out of 3 only the leases can have kept them apart.
    assert_disjoint_per_card(uses)


ONE_CASE = """
    import pytest

    from harness import LaunchSpec
    from recording import record_card_use


    @pytest.mark.launch(LaunchSpec(device="cuda", nproc=2, backend="gloo"))
    def test_two_cards():
        record_card_use("{name}")
"""


def test_two_sessions_sharing_a_lease_dir_take_turns(tmp_path):
    leases = tmp_path / "leases"
    sessions = []
    for name in ("first", "second"):
        root = write_project(tmp_path / name, {"test_one.py": ONE_CASE.replace("{name}", name)})
        env = inner_env(tmp_path / "out", leases, cards="cuda:0,1")
        (tmp_path / "out").mkdir(exist_ok=True)
        proc = subprocess.Popen(
            pytest_command(root, "--harness-max-procs", "8"),
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        sessions.append((root, proc))
    for root, proc in sessions:
        try:
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, output
        assert parse_junit(root / "junit.xml")["test_two_cards"].status == "passed"
    uses = read_card_uses(tmp_path / "out")
    assert sorted({u["case"] for u in uses}) == ["first", "second"]
    assert_disjoint_per_card(uses)


HELD_CARD = """
    import pytest

    from harness import LaunchSpec


    @pytest.mark.launch(LaunchSpec(device="cuda", nproc=1, backend="gloo"))
    def test_launched_needs_the_card():
        pass


    @pytest.mark.parametrize("device", ["cuda"])
    def test_plain_needs_the_card(device):
        pass
"""


def test_lease_wait_is_bounded_and_names_the_holder(pytester, monkeypatch, tmp_path):
    leases = str(tmp_path / "leases")
    monkeypatch.setenv("HARNESS_CARDS", "cuda:0")
    monkeypatch.setenv("HARNESS_LEASE_DIR", leases)
    pytester.makepyfile(test_held=HELD_CARD)
    with acquire(leases, [card_want([Card("cuda", "0")], 1)], timeout=0, holder="the outer test"):
        result = pytester.runpytest_subprocess(
            "--harness-lease-timeout=0.5", "-p", "no:cacheprovider"
        )
    result.assert_outcomes(failed=1, errors=1)
    holder = f"    cuda:0: held by pid {os.getpid()} (the outer test; for *"
    result.stdout.fnmatch_lines(
        [
            "*test_launched_needs_the_card: could not lease what the case needs",
            "lease wait timed out after 0.* s (lease dir *):",
            "  waited for 1 of the 1 cuda cards:",
            holder,
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*test_plain_needs_the_card?cuda?: could not lease a cuda card",
            "lease wait timed out after *",
            "  waited for 1 of the 1 cuda cards:",
            holder,
        ]
    )
