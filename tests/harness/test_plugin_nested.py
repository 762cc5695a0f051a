"""``harness.launch`` called from inside a test: nested launches run on what the
test holds, and all of them together never exceed it."""

from __future__ import annotations

import itertools
import json

import pytest
from launch_project import inner_env, run_session, write_project

NESTED = """
    import json
    import os
    import threading
    import time

    import pytest

    import harness
    from harness import LaunchSpec
    from recording import out_dir


    def hold_a_slot(name):
        start = time.time()
        time.sleep(0.5)
        record = {"start": start, "end": time.time(), "card": os.environ.get("HARNESS_CARD")}
        (out_dir() / f"nested-{name}.json").write_text(json.dumps(record))
        return os.environ.get("HARNESS_CARD")


    @pytest.mark.launch(nproc=1)
    def test_threads_share_the_case_slots():
        errors = []

        def one(name):
            try:
                harness.launch(hold_a_slot, LaunchSpec(nproc=1), f"thread-{name}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors


    @pytest.mark.parametrize("device", ["cuda"])
    def test_plain_test_launches_on_the_card_it_holds(device):
        held = os.environ["HARNESS_CARD"]
        spec = LaunchSpec(device="cuda", nproc=1, backend="gloo")
        assert harness.launch(hold_a_slot, spec, "on-card") == [held]
"""


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    root = write_project(tmp_path_factory.mktemp("nested"), {"test_nested.py": NESTED})
    env = inner_env(root / "out", root / "leases", cards="cuda:0")
    # A launch that waited for the card its own test holds would wait this long.
    return root, run_session(root, "--harness-lease-timeout", "20", env=env)


def test_nested_launches_from_threads_never_exceed_the_case_nproc(nested):
    root, session = nested
    assert session.case("test_threads_share_the_case_slots").status == "passed", session.output
    runs = [json.loads(p.read_text()) for p in (root / "out").glob("nested-thread-*.json")]
    assert len(runs) == 3
    runs.sort(key=lambda r: r["start"])
    for a, b in itertools.pairwise(runs):
        assert a["end"] <= b["start"], f"two nested launches ran at once on 1 slot: {runs}"


def test_plain_test_holding_the_only_card_launches_on_it(nested):
    root, session = nested
    case = session.case("test_plain_test_launches_on_the_card_it_holds[cuda]")
    assert case.status == "passed", case.text
    run = json.loads((root / "out" / "nested-on-card.json").read_text())
    assert run["card"] == "cuda:0"
