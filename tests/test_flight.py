"""The flight-recorder traces (megapipe/distributed/flight.py): read back from JSON files as the
ranks dump them, and the first collective some rank never entered, without any process group.
A real dump under a frozen rank: tests/test_stuck_rank.py."""

import json
import os

from megapipe.distributed import flight
from megapipe.distributed.flight import Entry, first_gap, read_traces, trace_path
from megapipe.distributed.progress import WAITING, WORKING, Record

GROUPS = {"0": ["default_pg", [0, 1, 2, 3]], "1": ["dp", [0, 1]], "2": ["dp", [2, 3]]}


def entry(group: str, seq: int, done: bool = True, t: float = 0.0, op: str = "all_reduce"):
    state = "completed" if done else "entered"
    return Entry(op, group, seq, False, [[8]], state, t or 100.0 + seq).__dict__


def write(run_dir, rank: int, entries: list[dict], tag: str = "launch") -> None:
    path = trace_path(str(run_dir), rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    d = {"rank": rank, "tag": tag, "dumped": 200.0, "groups": GROUPS, "entries": entries}
    with open(path, "w") as f:
        json.dump(d, f)


def test_the_rank_behind_is_named_and_the_ranks_waiting(tmp_path):
    done = [entry("0", 1), entry("1", 1), entry("2", 1)]
    for rank in (0, 2, 3):  # dp pair (2, 3) waits in seq 2 (ranks 2, 3 entered only by 2 and 3)
        extra = [entry("1" if rank < 2 else "2", 2)]
        write(tmp_path, rank, done + extra)
    write(tmp_path, 1, done)  # rank 1 never entered group 1's seq 2: rank 0 waits in it
    gap = first_gap(read_traces(str(tmp_path)))
    assert (gap.group, gap.seq, gap.missing, gap.untraced) == ("1", 2, [1], []), gap
    assert gap.waiting == [], gap  # rank 0's entry says completed: nobody waits
    write(tmp_path, 0, done + [entry("1", 2, done=False, t=50.0)])  # entered first, not done
    for rank in (2, 3):  # a later gap in the other pair: the earlier one is named
        write(tmp_path, rank, done + [entry("2", 2, done=False, t=150.0)])
    gap = first_gap(read_traces(str(tmp_path)))
    assert (gap.group, gap.seq, gap.waiting, gap.missing) == ("1", 2, [0], [1]), gap
    line = flight.gap_line(gap, {k: (d, r) for k, (d, r) in GROUPS.items()})
    assert line == (
        "first collective some rank never entered: all_reduce [[8]] over dp (ranks 0,1) seq 2, "
        "entered; rank 1 never entered it; waiting in it: rank 0"
    )


def test_a_rank_without_a_trace_never_entered_the_collective_the_others_wait_in(tmp_path):
    write(tmp_path, 0, [entry("1", 1), entry("1", 2, done=False)])
    gap = first_gap(read_traces(str(tmp_path)))
    assert (gap.seq, gap.waiting, gap.missing, gap.untraced) == (2, [0], [], [1]), gap
    write(tmp_path, 0, [entry("1", 1), entry("1", 2)])  # completed: no gap
    assert first_gap(read_traces(str(tmp_path))) is None


def test_matching_traces_and_other_launches_and_bad_files(tmp_path):
    for rank in range(4):
        write(tmp_path, rank, [entry("0", 1), entry("0", 2)])
    assert first_gap(read_traces(str(tmp_path))) is None
    write(tmp_path, 3, [entry("0", 1)], tag="earlier")
    assert sorted(read_traces(str(tmp_path), "launch")) == [0, 1, 2]
    with open(trace_path(str(tmp_path), 2), "w") as f:
        f.write("{not json")
    assert sorted(read_traces(str(tmp_path))) == [0, 1, 3]
    assert read_traces(str(tmp_path / "none")) == {}


def test_dump_without_a_run_dir_or_recorder_writes_nothing(tmp_path):
    assert flight.dump(None, 0) is None
    path = flight.dump(str(tmp_path), 0)  # no group in this process: torch's dump still parses
    assert path == trace_path(str(tmp_path), 0)
    assert read_traces(str(tmp_path))[0].groups == {}


def test_settle_marks_what_a_rank_entered_after_its_wait_began(tmp_path):
    """gloo may show the collective that timed out as completed; the record's wait tells."""
    write(tmp_path, 0, [entry("1", 1, t=10.0), entry("1", 2, t=30.0)])
    trace = read_traces(str(tmp_path))[0]
    base = dict(rank=0, world=2, coords={}, pid=1, started=0.0, timeout_s=10.0, host="h",
                tag="launch", beat=0.0, step=3, doing="step", doing_since=0.0, microbatch=-1,
                chunk=-1, wait="all_reduce loss", wait_since=20.0, peer=-1, wait_microbatch=-1,
                group="", exited=0.0)  # fmt: skip
    settled = flight.settle(trace, Record(**base, state=WAITING))
    assert [e.state for e in settled.entries] == ["completed", "waiting"]
    gap = first_gap({0: settled})
    assert (gap.seq, gap.waiting, gap.untraced) == (2, [0], [1]), gap
    assert flight.settle(trace, Record(**base, state=WORKING)) is trace
    p2p = Record(**{**base, "wait": "recv F"}, state=WAITING)
    assert flight.settle(trace, p2p) is trace
    assert first_gap({0: trace}) is None
