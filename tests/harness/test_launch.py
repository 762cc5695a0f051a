"""harness.launch from code: per-rank results, failures naming the rank, bad inputs."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import harness
from harness import LaunchError, LaunchSpec
from harness.launcher.rank import pg_timeout_for


def rank_facts(tag: str) -> tuple:
    import torch
    import torch.distributed as dist

    total = torch.tensor([1.0])
    dist.all_reduce(total)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return (tag, dist.get_rank(), int(total.item()), *(os.environ[n] for n in names))


def held_lock_files() -> tuple[list[str], list[str]]:
    """Lock files held by this rank, and by its supervisor (its parent)."""
    import psutil

    def locks(proc: psutil.Process) -> list[str]:
        return sorted(
            os.path.basename(f.path) for f in proc.open_files() if f.path.endswith(".lock")
        )

    return locks(psutil.Process()), locks(psutil.Process().parent())


def divide_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        1 / 0
    dist.barrier()


def test_launch_returns_each_ranks_result_in_rank_order():
    assert harness.launch(rank_facts, LaunchSpec(nproc=2), "x") == [
        ("x", 0, 2, "0", "2", "0", "2"),
        ("x", 1, 2, "1", "2", "1", "2"),
    ]


def test_rank_supervisors_hold_the_lease_of_their_case():
    # Inherited lock descriptors: the slots stay leased while any process of
    # the case lives (the supervisor is the last to exit), even if the
    # launching process were killed; the rank itself, and so whatever it
    # starts, holds none.
    for rank_held, supervisor_held in harness.launch(held_lock_files, LaunchSpec(nproc=2)):
        assert rank_held == []
        assert len(supervisor_held) == 2
        assert all(name.startswith("slot-") for name in supervisor_held)


def test_launch_failure_names_the_rank_and_shows_its_traceback():
    with pytest.raises(LaunchError) as info:
        harness.launch(divide_on_rank_1, LaunchSpec(nproc=2))
    message = str(info.value)
    assert message.startswith(
        "rank 1 failed: ZeroDivisionError: division by zero\n(2 ranks, cpu/gloo)"
    )
    assert "in divide_on_rank_1\n    1 / 0" in message
    assert info.value.result.status == "failed"


def test_launch_needs_an_importable_function():
    with pytest.raises(ValueError, match="defined at module level"):
        harness.launch(lambda: None, LaunchSpec())


def test_launch_names_an_argument_it_cannot_send():
    with pytest.raises(TypeError, match=r"argument 1 \(a _thread\.lock\) cannot be sent"):
        harness.launch(rank_facts, LaunchSpec(), "ok", threading.Lock())


@given(st.floats(min_value=0.01, max_value=1e6))
def test_process_group_timeout_is_below_the_case_deadline(deadline):
    assert 0 < pg_timeout_for(deadline) < deadline or deadline <= 0.1
    assert pg_timeout_for(deadline) >= deadline - 30


def test_rank_output_is_read_back_to_its_head_and_tail(tmp_path):
    from harness.launcher.outcome import OUTPUT_HEAD_BYTES, OUTPUT_TAIL_BYTES, read_bounded

    path = tmp_path / "rank-0.log"
    lines = [f"line {i:07d}\n" for i in range(400_000)]  # 5.2 MB
    path.write_text("".join(lines))
    size = os.path.getsize(path)
    text = read_bounded(str(path))
    head, _, rest = text.partition("\n[harness: ")
    note, _, tail = rest.partition("]\n")
    assert "".join(lines).startswith(head)
    assert "".join(lines).endswith(tail)
    assert note.startswith(
        f"{size - OUTPUT_HEAD_BYTES - OUTPUT_TAIL_BYTES} bytes of this rank's output dropped"
    )
    assert len(text) < OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES + 200
    short = tmp_path / "short.log"
    short.write_text("all of it\n")
    assert read_bounded(str(short)) == "all of it\n"
