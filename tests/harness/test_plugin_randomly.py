"""pytest-randomly's per-test seed reaches the ranks: a launched test drawing from
``random`` / numpy sees, on every rank, what the same test sees in-process under the
same ``--randomly-seed``, so a failure is replayed by that seed (fresh and kept ranks)."""

from __future__ import annotations

import json

import pytest
from launch_project import inner_env, run_session, write_project

pytest.importorskip("pytest_randomly")

# One test id, run in-process or launched: HARNESS_TEST_LAUNCHED decides the marker.
TESTS = """
    import json
    import os
    import random

    import numpy
    import pytest

    from recording import out_dir

    launched = (
        pytest.mark.launch(nproc=2) if os.environ.get("HARNESS_TEST_LAUNCHED") else lambda f: f
    )


    @launched
    def test_draws():
        draws = [random.random(), float(numpy.random.rand())]
        name = f"draws-{os.environ.get('RANK', 'here')}.json"
        (out_dir() / name).write_text(json.dumps(draws))
"""


def _draws(root, seed, *, launched, reuse=False):
    out = root / "out"
    for old in out.glob("draws-*.json"):
        old.unlink()
    env = inner_env(out, root / "leases")
    if launched:
        env["HARNESS_TEST_LAUNCHED"] = "1"
    session = run_session(
        root,
        "-p",
        "randomly",
        f"--randomly-seed={seed}",
        *(["--harness-reuse"] if reuse else []),
        env=env,
    )
    assert session.returncode == 0, session.output
    return {p.stem: json.loads(p.read_text()) for p in out.glob("draws-*.json")}


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "kept"])
def test_ranks_draw_what_the_in_process_test_draws(tmp_path, reuse):
    # Regression: the ranks never reseeded, so their draws ignored --randomly-seed
    # (fresh ranks drew from the OS's entropy, kept ranks from the pool's baseline).
    root = write_project(tmp_path / "project", {"test_rng.py": TESTS})
    here = _draws(root, 1234, launched=False)["draws-here"]
    launched = _draws(root, 1234, launched=True, reuse=reuse)
    assert launched == {"draws-0": here, "draws-1": here}
    other = _draws(root, 4321, launched=True, reuse=reuse)
    assert other["draws-0"] != here
