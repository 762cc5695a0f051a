"""Benchmark the attribution and the step meter's communication.

1. ``source_totals`` time for one packed batch of ``--tokens`` tokens split
   into 10 vs 10,000 samples: the work is per token, so the two should be
   within 2x of each other (flat in the number of samples).
2. Collectives per logged step of ``ChannelLossMeter`` (target <= 2), per
   micro-batch (target 0) and per unsampled step (target 0), counted by
   wrapping the ``torch.distributed`` functions in real Gloo runs: SP=2,
   DP=2, SP=2 x DP=2, and SP=2 x DP=2 with 300 micro-batches per step of
   which one (index 299, on rank 0) fails: exactly 1 dropped per logged step.

    python scripts/bench/attribution.py [--tokens 1000000] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from channel_loss import ChannelLossMeter, PackedLayout, source_totals
from channel_loss.capture import record
from channel_loss.exchange import count_collectives


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_source_totals(
    tokens: int, samples: int, repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds of building the layout, and of ``source_totals``, for one batch."""
    g = torch.Generator().manual_seed(0)
    cu = torch.linspace(0, tokens, samples + 1).round().to(torch.int64)
    source_ids = [f"source-{k % 32}" for k in range(samples)]
    losses = torch.rand(tokens, generator=g).to(device)
    targets = torch.randint(-1, 1000, (tokens,), generator=g).clamp(min=-100).to(device)
    build, attribute = [], []
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        layout = PackedLayout.from_cu_seqlens(cu.to(device), total_length=tokens)
        build.append(time.perf_counter() - start)
        layout.on(device)
        _sync(device)
        start = time.perf_counter()
        totals = source_totals(losses, targets, layout=layout, source_ids=source_ids)
        _sync(device)
        attribute.append(time.perf_counter() - start)
    assert int(totals.samples.sum()) == samples
    return statistics.median(build[1:]), statistics.median(attribute[1:])


#: name: (sp, dp, micro-batches per step, the micro-batch that fails on rank 0 or -1)
SCENARIOS = {
    "SP=2": (2, 1, 2, -1),
    "DP=2": (1, 2, 2, -1),
    "SP=2 x DP=2": (2, 2, 2, -1),
    "300 mb, 1 fail": (2, 2, 300, 299),
}


class _Failed(RuntimeError):
    pass


def _meter_rank(
    rank: int, world: int, store: str, sp: int, dp: int, micro: int, fail: int, results
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # Rank r is SP rank r % sp of DP rank r // sp; every rank creates every group, in order.
    sp_groups = [dist.new_group([d * sp + s for s in range(sp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * sp + s for d in range(dp)]) for s in range(sp)]
    sp_rank, dp_rank = rank % sp, rank // sp
    meter = ChannelLossMeter(
        sp_group=sp_groups[dp_rank] if sp > 1 else None,
        dp_group=dp_groups[sp_rank] if dp > 1 else None,
        interval=2,
    )
    layout = PackedLayout.from_cu_seqlens([0, 100, 250, 256], total_length=256)
    shard = layout.shard(sp, sp_rank, "zigzag")
    losses, targets = (
        shard.take(torch.rand(256), 0.0),
        shard.take(torch.randint(0, 9, (256,)), -100),
    )
    counts = {"step": [], "micro_batch": [], "unsampled": [], "dropped": []}
    for _ in range(4):
        meter.begin_step()
        for m in range(micro):
            # Step 0 meets every source for the first time; step 2 only known ones.
            sources = [f"dp{dp_rank}-{m % 2}", "shared", m % 2]
            try:
                with (
                    count_collectives() as calls,
                    meter.micro_batch(source_ids=sources, layout=layout, shard=shard),
                ):
                    record(losses, targets)
                    if rank == 0 and m == fail:
                        raise _Failed
            except _Failed:
                pass
            counts["micro_batch"].append(len(calls))
        sampled = meter.sampled
        with count_collectives() as calls:
            metrics = meter.end_step()
        counts["step" if sampled else "unsampled"].append(len(calls))
        if sampled:
            counts["dropped"].append(int(metrics["channel_loss_dropped_micro_batches"]))
    if rank == 0:
        results.put(counts)
    dist.destroy_process_group()


def count_meter_collectives(
    sp: int, dp: int, micro: int = 2, fail: int = -1
) -> dict[str, list[int]]:
    """Collective calls per end_step / micro_batch / unsampled step on an ``sp x dp`` Gloo run.

    Also the dropped micro-batches of each logged step (``fail``: the index
    that fails on rank 0, -1 for none).
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _meter_rank,
            args=(sp * dp, os.path.join(tmp, "store"), sp, dp, micro, fail, results),
            nprocs=sp * dp,
            start_method="spawn",
        )
        return results.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    print(f"source_totals on {device}, {args.tokens:,} tokens (median of {args.repeats})")
    print(f"{'samples':>8} | {'layout build ms':>15} | {'source_totals ms':>16}")
    times = {}
    for samples in (10, 10_000):
        build, attribute = time_source_totals(args.tokens, samples, args.repeats, device)
        times[samples] = attribute
        print(f"{samples:>8,} | {build * 1e3:>15.2f} | {attribute * 1e3:>16.2f}")
    ratio = times[10_000] / times[10]
    print(f"ratio 10,000 / 10 samples: {ratio:.2f} (target <= 2)\n")

    print("collectives per call (Gloo; step 0 registers new sources, step 2 is steady)")
    print(
        f"{'scenario':>14} | {'ranks':>5} | {'logged step':>11} | {'micro-batch':>11} | "
        f"{'unsampled step':>14} | {'dropped':>7}"
    )
    worst, exact = 0, True
    for name, (sp, dp, micro, fail) in SCENARIOS.items():
        counts = count_meter_collectives(sp, dp, micro, fail)
        worst = max(worst, *counts["step"])
        exact &= counts["dropped"] == [int(fail >= 0)] * len(counts["dropped"])
        print(
            f"{name:>14} | {sp * dp:>5} | {'/'.join(map(str, counts['step'])):>11} | "
            f"{max(counts['micro_batch']):>11} | {max(counts['unsampled']):>14} | "
            f"{'/'.join(map(str, counts['dropped'])):>7}"
        )
    print(
        f"most collectives in a logged step: {worst} (target <= 2); "
        f"dropped exactly the failed micro-batch: {exact}"
    )
    return 0 if ratio <= 2 and worst <= 2 and exact else 1


if __name__ == "__main__":
    sys.exit(main())
