"""Each rank's progress record (megapipe/distributed/progress.py) and the rule that names the
stopped ranks from them (megapipe/distributed/diagnosis.py), without any process group."""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megapipe.cli import diagnose
from megapipe.distributed import diagnosis
from megapipe.distributed.diagnosis import classify, lost_peer_line, named, stale_s
from megapipe.distributed.progress import (
    BEAT_S,
    NO_PROGRESS,
    WAITING,
    WORKING,
    Progress,
    read_record,
    read_records,
    record_path,
)

NOW = 4_000_000_000.0  # later than any clock the tests run at
COORDS = ("pp", "dp", "cp", "tp")


def recorder(rank: int, world: int = 2, timeout_s: float = 10.0, **coords) -> Progress:
    return Progress(rank, world, {a: coords.get(a, 0) for a in COORDS}, timeout_s)


def test_record_round_trip(tmp_path):
    p = recorder(1, pp=1, tp=1)
    p.open(str(tmp_path))
    try:
        p.step(3)
        p.doing("F", 5)
        p.wait("recv F", 0, 5)
        r = read_record(record_path(str(tmp_path), 1))
        assert (r.rank, r.world, r.pid, r.host) == (1, 2, os.getpid(), socket.gethostname())
        assert r.coords == {"pp": 1, "dp": 0, "cp": 0, "tp": 1} and r.timeout_s == 10.0
        assert (r.step, r.doing, r.microbatch, r.state) == (3, "F", 5, WAITING)
        assert r.where() == "at recv F mb 5 from rank 0, step 3"
        p.waited()
        assert read_record(record_path(str(tmp_path), 1)).where() == "in F mb 5, step 3"
        p.wait("all_reduce grads", group="dp")
        assert read_records(str(tmp_path))[1].where() == "at all_reduce grads over dp, step 3"
        p.doing("B", 2, 1)
        assert read_records(str(tmp_path))[1].where() == "in B mb 2 chunk 1, step 3"
        assert read_records(str(tmp_path))[1].exited == 0.0
    finally:
        p.close()
    r = read_record(record_path(str(tmp_path), 1))
    assert r.exited > 0 and r.state == WORKING and r.doing == "B"  # where it was stays


def test_heartbeat_goes_on_while_the_rank_does_nothing(tmp_path):
    p = recorder(0)
    p.open(str(tmp_path))
    try:
        first = read_record(record_path(str(tmp_path), 0)).beat
        time.sleep(3 * BEAT_S)
        assert read_record(record_path(str(tmp_path), 0)).beat >= first + BEAT_S
    finally:
        p.close()
    closed = read_record(record_path(str(tmp_path), 0)).beat
    time.sleep(2 * BEAT_S)
    assert read_record(record_path(str(tmp_path), 0)).beat == closed  # the thread stopped


def test_no_progress_writes_nothing(tmp_path):
    NO_PROGRESS.open(str(tmp_path))
    NO_PROGRESS.step(1)
    NO_PROGRESS.wait("recv F", 0)
    NO_PROGRESS.close()
    assert not (tmp_path / "progress").exists()


def test_not_a_record_is_skipped(tmp_path):
    (tmp_path / "progress").mkdir()
    (tmp_path / "progress" / "rank0").write_bytes(b"junk")
    (tmp_path / "progress" / "notes").write_text("x")
    assert read_records(str(tmp_path)) == {}


def make(rank: int, beat_ago: float = 0.0, state: int = WORKING, **fields):
    """A record of rank `rank` on another host (no process check), its heartbeat `beat_ago`
    seconds before NOW."""
    base = dict(
        rank=rank, world=4, coords={"pp": rank // 2, "dp": rank % 2, "cp": 0, "tp": 0},
        pid=1, started=NOW - 100, timeout_s=10.0, host="elsewhere", tag="job", beat=NOW - beat_ago,
        step=3, doing="F", doing_since=NOW - beat_ago - 1, microbatch=2, chunk=-1, state=state,
        wait="recv F", wait_since=NOW - 9, peer=0, wait_microbatch=2, group="", exited=0.0,
    )  # fmt: skip
    return diagnosis.Record(**{**base, **fields})


def verdicts(records, me=None, host="here"):
    return {f.rank: f.verdict for f in classify(records, me, host=host)}


def test_stale_heartbeat_is_a_stopped_rank_fresh_ones_wait_or_work():
    assert stale_s(10) == 5 and stale_s(1) == 3 and stale_s(600) == 10
    records = {
        0: make(0, state=WAITING),
        1: make(1, beat_ago=9),  # behind the newest by more than 5 s
        2: make(2, beat_ago=4, state=WAITING),  # within: alive
        3: make(3, beat_ago=0.5),
    }
    assert verdicts(records, me=0) == {1: "stopped", 2: "waiting", 3: "busy"}
    assert [f.rank for f in named(classify(records, 0, host="here"))] == [1]
    records[1] = make(1, beat_ago=1, state=WAITING)  # none stopped: the one not waiting
    assert [f.rank for f in named(classify(records, 0, host="here"))] == [3]


def test_other_launch_and_missing_ranks_have_no_record():
    records = {0: make(0, state=WAITING), 1: make(1, tag="earlier"), 2: make(2), 3: make(3)}
    found = classify(records, 0, host="here")
    assert [(f.rank, f.verdict) for f in named(found)] == [(1, "no record")]
    assert "rank 1 has no record" in diagnosis.describe(named(found)[0])


def test_exited_before_busy_and_order_oldest_first():
    records = {
        0: make(0, state=WAITING),
        1: make(1, exited=NOW - 12),  # before rank 0 began to wait
        2: make(2, beat_ago=8),
        3: make(3, beat_ago=7),
    }
    found = classify(records, 0, host="here")
    assert [(f.rank, f.verdict) for f in found] == [(2, "stopped"), (3, "stopped"), (1, "exited")]
    assert diagnosis.describe(found[0]) == (
        "rank 2 (pp=1 dp=0 cp=0 tp=0) stopped 8 s ago in F mb 2, step 3"
    )


def test_a_rank_that_exited_after_this_one_began_to_wait_gave_up_too():
    records = {
        0: make(0, state=WAITING, wait_since=NOW - 10),
        1: make(1, exited=NOW - 1),  # timed out on the same peer, a moment before this one
        2: make(2, exited=NOW - 12),  # left before: the others wait for it
        3: make(3, state=WAITING),
    }
    assert verdicts(records, 0) == {1: "gave up", 2: "exited", 3: "waiting"}
    records[2] = make(2, beat_ago=1)
    assert [f.rank for f in named(classify(records, 0, host="here"))] == [2]  # busy


def test_every_rank_waiting_is_said():
    records = {k: make(k, state=WAITING) for k in range(4)}
    assert named(classify(records, 0, host="here")) == []


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_processes_on_this_host_dead_or_frozen(child):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its pid is gone
    here = socket.gethostname()
    records = {
        0: make(0, host=here, pid=os.getpid()),
        1: make(1, host=here, pid=done.pid),
        2: make(2, host=here, pid=child.pid),
        3: make(3, host=here, pid=child.pid, state=WAITING),
    }
    assert verdicts(records, 0, here) == {1: "died", 2: "busy", 3: "waiting"}
    os.kill(child.pid, signal.SIGSTOP)
    for _ in range(100):  # the state changes asynchronously
        if diagnosis.process_state(child.pid) == "T":
            break
        time.sleep(0.05)
    assert verdicts(records, 0, here) == {1: "died", 2: "stopped", 3: "stopped"}
    records = {k: dataclasses.replace(r, pid=done.pid) for k, r in records.items()}
    records[2] = dataclasses.replace(records[2], beat=NOW - 8)
    # a job whose processes are all gone (tools/diagnose.py after a kill): heartbeats decide
    assert verdicts(records, None, here) == {0: "busy", 1: "busy", 2: "stopped", 3: "waiting"}


def test_lost_peer_line_and_diagnose_from_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASTER_PORT", "4242")
    ranks = [recorder(r, pp=r) for r in range(2)]
    for p in ranks:
        p.open(str(tmp_path))
    ranks[0].step(4)
    ranks[0].wait("recv F", 1, 3)
    ranks[1].step(4)
    ranks[1].doing("F", 3)
    ranks[1]._stop.set()  # its heartbeat stops, as under SIGSTOP; the file's pid is ours
    ranks[1]._thread.join()
    monkeypatch.setattr(diagnosis, "process_state", lambda pid: None)  # not on this host
    time.sleep(stale_s(10) + 2 * BEAT_S)
    line = lost_peer_line(str(tmp_path), 0, "Timed out")
    assert line.startswith("rank 1 (pp=1 dp=0 cp=0 tp=0) stopped ")
    assert " s ago in F mb 3, step 4; rank 0 gave up at recv F mb 3 from rank 1, step 4 " in line
    assert f"python tools/diagnose.py {tmp_path}" in line
    assert diagnose.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("launch :::4242: 2 records") and out[1].startswith("rank 1 (")
    assert "stopped" in out[1] and "in F mb 3, step 4" in out[1]
    assert out[2].startswith("rank 0 (") and "waiting" in out[2]
    for p in ranks:
        p.close()
    assert lost_peer_line(str(tmp_path / "none"), 0, "x") is None


def test_diagnose_without_records_is_one_line(tmp_path, capsys):
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no progress records in")


def test_a_closed_connection_waits_for_the_peers_heartbeat_to_go_stale(tmp_path, monkeypatch):
    """A peer on another host that died looks alive until its heartbeat is stale_s old."""
    monkeypatch.setattr(diagnosis, "process_state", lambda pid: None)  # not on this host
    ranks = [recorder(r, pp=r, timeout_s=2.0) for r in range(2)]
    for p in ranks:
        p.open(str(tmp_path))
        p.step(1)
        p.wait("recv F", 1 - p.rank, 0)  # both wait: nobody to name yet
    ranks[1]._stop.set()  # dies now
    ranks[1]._thread.join()
    ranks[0].close()  # as train.py's run ends before it writes the line
    began = time.monotonic()
    line = lost_peer_line(str(tmp_path), 0, "Connection closed by peer")
    waited = time.monotonic() - began
    for p in ranks:
        p.close()
    assert line.startswith("rank 1 (pp=1 dp=0 cp=0 tp=0) stopped "), line
    assert stale_s(2.0) - BEAT_S <= waited <= stale_s(2.0) + 3 * BEAT_S + 5  # loaded machine
    assert lost_peer_line(str(tmp_path), 0, "Timed out").startswith("no other rank stopped")
