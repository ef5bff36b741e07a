"""Which ranks stopped, and where: read from the per-rank records (distributed/progress.py).

The rule (`classify`), for the ranks of one launch (records with the reader's launch tag, or
the tag of the newest heartbeat when the reader is no rank, as tools/diagnose.py):

- a rank whose record was closed `exited` (its run ended, normally or with an error);
- else, on this host, a rank whose process is gone or a zombie `died`, and one frozen by a
  signal (`T` in /proc: SIGSTOP, a debugger) `stopped`;
- else a rank whose heartbeat (written once a second by a thread of its own, which goes on
  while the rank computes or waits) is more than `stale_s(parallel.timeout_s)` older than the
  newest heartbeat of the launch `stopped` (responding): its process is frozen, dead on another
  host, or its host is gone;
- else the rank is alive and `waiting` (in a receive or a collective) or `busy` (computing,
  saving).

A rank that waited `parallel.timeout_s` for its peers names the first kind that any other rank
of the launch falls in, in this order: died or stopped, no record (it never reached training),
exited (before this rank began to wait: one that exited later `gave up` on the same peers, and
is not named), busy (the others wait for it), and if every other rank waits too, says so (a
mismatched collective). Ages are measured from the newest heartbeat (by a rank: from now).
tools/diagnose.py reads a job killed from outside the same way after the fact; when every
process of the job is gone, only the heartbeats tell, and the ranks that stopped before the
others come first.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from megapipe.distributed.progress import BEAT_S, WAITING, Record, read_records

ORDER = ("died", "stopped", "no record", "exited", "busy", "waiting", "gave up")
SHOWN = 4  # ranks named in one line; the rest counted
GONE = ("gone", "Z", "X")  # /proc states of a process that died


def stale_s(timeout_s: float) -> float:
    """A heartbeat older than this (behind the newest) is a stopped rank: half the timeout,
    within [3, 10] s (the beat comes every second; a loaded machine delays it by a few)."""
    return min(10.0, max(3.0, timeout_s / 2))


@dataclass(frozen=True)
class Finding:
    rank: int
    verdict: str  # one of ORDER
    record: Record | None
    age: float  # seconds before the newest heartbeat: since the last beat, exit or action


def process_state(pid: int) -> str | None:
    """This host's /proc state letter of `pid` (R, S, D, T, t, Z, ...); "gone"; None: unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None


def classify(
    records: dict[int, Record], me: int | None = None, host: str | None = None
) -> list[Finding]:
    """Every rank of the launch but `me`, each with its verdict (see the module docstring),
    in ORDER and oldest first within a kind."""
    if not records:
        return []
    host = socket.gethostname() if host is None else host
    ref = records[me] if me in records else max(records.values(), key=lambda r: r.beat)
    ours = {k: r for k, r in records.items() if r.tag == ref.tag and r.world == ref.world}
    newest = max(r.beat for r in ours.values())
    if me is not None:  # the reader is alive now (its own record may be closed already)
        newest = max(newest, time.time())
    stale = stale_s(ref.timeout_s)
    states = {k: process_state(r.pid) if r.host == host else None for k, r in ours.items()}
    if me is None and all(s in GONE for s in states.values()):  # the whole job was killed:
        states = dict.fromkeys(states)  # who stopped first shows only in the heartbeats
    # a rank that exited after this one began to wait gave up on the same peers, as this one
    began = (ref.wait_since if ref.state == WAITING else ref.doing_since) if me in ours else None
    out = []
    for rank in range(ref.world):
        if rank == me:
            continue
        r = ours.get(rank)
        if r is None:
            out.append(Finding(rank, "no record", None, 0.0))
            continue
        verdict, since = _verdict(r, states[rank], newest, stale)
        if verdict == "exited" and began is not None and r.exited > began:
            verdict = "gave up"
        out.append(Finding(rank, verdict, r, max(newest - since, 0.0)))
    return sorted(out, key=lambda f: (ORDER.index(f.verdict), -f.age, f.rank))


def _verdict(r: Record, state: str | None, newest: float, stale: float) -> tuple[str, float]:
    """(verdict, the time it dates from) of one record; `state`: its process's (None: unknown)."""
    if r.exited:
        return "exited", r.exited
    if state in GONE:
        return "died", r.beat
    if state in ("T", "t") or newest - r.beat > stale:
        return "stopped", r.beat
    if r.state == WAITING:
        return "waiting", r.wait_since
    return "busy", r.doing_since


def describe(f: Finding) -> str:
    """`rank 1 (pp=1 dp=0 cp=0 tp=0) stopped 15 s ago at recv F mb 5 from rank 0, step 3`."""
    if f.record is None:
        return f"rank {f.rank} has no record (it never reached training)"
    r, secs = f.record, f"{f.age:.0f} s"
    when = {
        "died": f"died {secs} ago",
        "stopped": f"stopped {secs} ago",
        "exited": f"exited {secs} ago",
        "busy": f"busy for {secs}",
        "waiting": f"waiting for {secs}",
        "gave up": f"gave up {secs} ago",
    }[f.verdict]
    return f"rank {f.rank} ({r.coords_text()}) {when} {r.where()}"


def named(findings: list[Finding]) -> list[Finding]:
    """The ranks a line names: every rank of the first kind in ORDER present (but `waiting`
    and `gave up`)."""
    for kind in ORDER[:-2]:
        chosen = [f for f in findings if f.verdict == kind]
        if chosen:
            return chosen
    return []


def lost_peer_line(run_dir: str | None, me: int, cause: str) -> str | None:
    """The line of a rank whose wait on its peers failed (`cause`): the ranks that stopped and
    where, then where this rank waited; None when there are no records to read."""
    records = read_records(run_dir) if run_dir else {}
    if me not in records:
        return None
    chosen = named(classify(records, me))
    if not chosen and not any(w in cause.lower() for w in ("timeout", "timed out")):
        # a peer closed the connection: on another host its death shows only when its
        # heartbeat goes stale, which takes at most stale_s
        deadline = time.monotonic() + stale_s(records[me].timeout_s) + 2 * BEAT_S
        while not chosen and time.monotonic() < deadline:
            time.sleep(BEAT_S)
            records = read_records(run_dir)
            chosen = named(classify(records, me))
    if chosen:
        parts = [describe(f) for f in chosen[:SHOWN]]
        more = len(chosen) - SHOWN
        head = "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
    else:
        head = "no other rank stopped: every rank waits (a collective or message the others "
        head += "never post)"
    own = records[me]
    return (
        f"{head}; rank {me} gave up {own.where()} ({cause}; "
        f"parallel.timeout_s={own.timeout_s:g}); every rank's last record: "
        f"python tools/diagnose.py {run_dir}"
    )


def report(run_dir: str) -> list[str]:
    """tools/diagnose.py: one line per rank of the newest launch in `run_dir`, stopped first."""
    records = read_records(run_dir)
    if not records:
        return []
    findings = classify(records)
    newest = max(records.values(), key=lambda r: r.beat)
    # the ranks whose heartbeat stopped first lead, whether they died or froze
    lead = sorted((f for f in findings if f.verdict in ("died", "stopped")), key=_silent_since)
    rest = [f for f in findings if f not in lead]
    return [
        f"launch {newest.tag or '-'}: {len(records)} records in "
        f"{os.path.join(run_dir, 'progress')}, last heartbeat {_clock(newest.beat)} "
        f"(rank {newest.rank})"
    ] + [_line(f, newest.beat) for f in lead + rest]


def _silent_since(f: Finding) -> float:
    return f.record.beat if f.record is not None else 0.0


def _line(f: Finding, newest: float) -> str:
    """tools/diagnose.py's line of one rank: its verdict, when, and where it was."""
    if f.record is None:
        return describe(f)
    r = f.record
    when = f"exited {_clock(r.exited)}" if f.verdict == "exited" else f.verdict
    if f.verdict == "waiting":
        when += f" for {newest - r.wait_since:.0f} s"
    return (
        f"rank {f.rank} ({r.coords_text()}, {r.host} pid {r.pid}) {when}, last heartbeat "
        f"{_clock(r.beat)} ({newest - r.beat:.0f} s before the last), {r.where()}"
    )


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
