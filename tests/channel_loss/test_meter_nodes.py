"""ChannelLossMeter across two nodes (the harness emulates them on one host,
torch's elastic agent starts each node's ranks): SP inside a node, DP across
nodes, exactly the metrics of the single-node reference.

The same micro-batches and layout as the single-node 2 x 2 case of
``test_meter_dist.py`` (``test_four_ranks_sp_dp_and_sp_by_dp_subgroups``),
whose result is the same plain-loop reference: with integer-valued losses
every sum is exact, so the comparison is equality, not a tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from channel_loss import ChannelLossMeter
from channel_loss.layout import SHARD_MODES
from tests.channel_loss.test_meter_dist import DP_SOURCES, expected, micro_batches, run_step


@pytest.mark.launch(nnodes=2, nproc=2, timeout=240)
def test_sp_inside_each_node_dp_across_nodes_equals_the_single_node_result():
    # torchrun's numbering: node = GROUP_RANK, rank = 2 * node + LOCAL_RANK.
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    assert dist.get_rank() == 2 * node + local
    # Every rank creates every group, in one order.
    sp_groups = [dist.new_group([2 * n, 2 * n + 1]) for n in range(2)]  # inside node n
    dp_groups = [dist.new_group([slot, 2 + slot]) for slot in range(2)]  # across the nodes
    meter = ChannelLossMeter(sp_group=sp_groups[node], dp_group=dp_groups[local])
    own = [micro_batches(seed=300 + d, sources=DP_SOURCES[d]) for d in range(2)]
    for mode in SHARD_MODES:
        got = run_step(meter, own[node], "cpu", shard=(2, local, mode))
        assert got == expected(*own)
    # Node 1's second rank fails its forward in micro-batch 1: only node 1's SP
    # group drops it, and node 0's DP peers still agree on the step.
    failing = {1} if (node, local) == (1, 1) else ()
    got = run_step(meter, own[node], "cpu", shard=(2, local, "zigzag"), fail=failing)
    assert got == expected(own[0], [own[1][0], own[1][2]], dropped=1)
