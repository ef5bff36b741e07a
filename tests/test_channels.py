"""Per-channel message order (pipeline/channels.py): what NCCL, which ignores tags, needs."""

import pytest

from megapipe.plan.actions import Action, Placement
from megapipe.plan.channels import channel_orders, fifo_mismatch
from megapipe.plan.schedules import build_schedule, placement


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zb_h2"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 3), (4, 4), (4, 7), (8, 12)])
def test_one_chunk_schedules_keep_every_channel_in_order(name, pp, m):
    assert fifo_mismatch(build_schedule(name, pp, m), placement(name, pp)) is None


def test_every_send_has_its_receive_on_the_same_channel():
    s = build_schedule("interleaved_1f1b", 4, 6, 2)
    sends, recvs = channel_orders(s, placement("interleaved_1f1b", 4, 2))
    assert sends.keys() == recvs.keys()
    for pair in sends:
        assert sorted(sends[pair]) == sorted(recvs[pair]), pair
    # 4 ranks in a loop of 8 stages: activations 0->1->2->3->0 and grads back, 6 microbatches
    assert sum(len(v) for v in sends.values()) == 2 * 6 * 7


def test_zb_v_turn_is_local_and_takes_no_channel():
    s = build_schedule("zb_v", 2, 2, 2)
    sends, _ = channel_orders(s, placement("zb_v", 2, 2))
    # Stages 0, 3 on rank 0 and 1, 2 on rank 1: boundary 1 (1->2) stays on rank 1. Rank 0 ->
    # rank 1 carries boundary 0's activation and boundary 2's grad, for each of 2 microbatches.
    assert len(sends[(0, 1)]) == len(sends[(1, 0)]) == 2 * 2


def test_out_of_order_channels_are_found():
    """Some schedules consume a channel out of its send order (gloo's tags hide it)."""
    assert "ranks 0->1" in fifo_mismatch(build_schedule("zb_v", 2, 3, 2), placement("zb_v", 2, 2))
    found = fifo_mismatch(
        build_schedule("interleaved_1f1b", 2, 5, 2), placement("interleaved_1f1b", 2, 2)
    )
    assert found is not None and "sent ('grad', 0, 0, 1) but received ('act', 3, 0, 0)" in found


def test_swapped_receives_are_a_mismatch():
    sched = {
        0: [Action("F", 0), Action("F", 1), Action("BW", 1), Action("BW", 0)],
        1: [Action("F", 1), Action("F", 0), Action("BW", 1), Action("BW", 0)],
    }
    msg = fifo_mismatch(sched, Placement(2))
    assert msg == "ranks 0->1: message 0 sent ('act', 0, 0, 0) but received ('act', 1, 0, 0)"
