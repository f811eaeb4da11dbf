"""The throughput benchmark sets our schedules against torch.distributed.pipelining's as equals: with one
stage per rank, torch's ScheduleInterleavedZeroBubble runs zb-h1's order of computes and Schedule1F1B
1f1b's."""

import sys
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble

from hf_noloco.engine.schedule import pipeline_order
from tests.helpers.scripts import BENCHMARKS

if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
import _torch_pipelining


def _stage(index: int, stages: int):
    # What the schedules' constructors read of a stage: building the plan needs no process group.
    return SimpleNamespace(
        stage_index=index,
        num_stages=stages,
        group_size=stages,
        group_rank=index,
        submod=torch.nn.Linear(1, 1),
        stage_index_to_group_rank=None,
    )


def test_torch_orders_are_ours():
    def loss(output, target):
        return output

    for stages, num_micro in [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)]:  # Schedule1F1B: micro >= stages
        for s in range(stages):
            zero_bubble = ScheduleInterleavedZeroBubble([_stage(s, stages)], num_micro, loss_fn=loss)
            one_f_one_b = Schedule1F1B(_stage(s, stages), num_micro, loss_fn=loss)
            for ours, theirs in (("zb-h1", zero_bubble), ("1f1b", one_f_one_b)):
                got = _torch_pipelining.order(theirs, s, stages, num_micro)
                assert got == pipeline_order(ours, num_micro, stages, s), (ours, stages, num_micro, s)
