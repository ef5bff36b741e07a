"""Each rank's flight-recorder trace, dumped when it gives up on its peers, and the collective
some rank never entered, read from every rank's dump.

torch's flight recorder (torchtitan and Megatron use it for hangs; torchtitan's
`comm.trace_buf_size`) keeps, per process, the last `TORCH_FR_BUFFER_SIZE` collectives it entered:
the op, its group, input sizes, a sequence id per group, and whether it completed. The launcher
turns it on for every multi-rank run (`ensure_buffer`, distributed/launch.py). A rank whose wait
failed (parallel.timeout_s passed, a peer closed the connection) writes `dump` to
`run.dir/progress/rank<R>.fr.json`, beside its progress record (distributed/progress.py): torch's
JSON dump, never its pickle, cut to what `first_gap` reads, with the ranks of each group.

Under gloo (torch 2.13) the recorder holds collectives only: send and recv are not recorded, so a
pipeline rank waiting in a receive shows in its progress record (`at recv B mb 3 from rank 1`),
not here. Under NCCL they are recorded as p2p entries, shown as a rank's last entry but not
matched (their sequence ids count per pair of ranks).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace

from megapipe._torch_compat import flight_recorder_trace, process_group_ranks
from megapipe.distributed.progress import WAITING, Record, launch_tag

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
P2P = ("recv", "send", "swap")  # the progress records' point-to-point waits
BUFFER_DEFAULT = "2000"  # entries: a few steps of every group's collectives, ~1 MB per rank


def ensure_buffer() -> None:
    """Record collectives unless the user sized the buffer; read when the first group is made."""
    os.environ.setdefault(BUFFER_ENV, BUFFER_DEFAULT)


def trace_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "progress", f"rank{rank}.fr.json")


@dataclass(frozen=True)
class Entry:
    """One collective a rank entered, as its flight recorder saw it."""

    op: str  # all_reduce, broadcast, barrier, send ...
    group: str  # the group's name, the same on every rank
    seq: int  # the collective's sequence id within its group (p2p: per pair)
    p2p: bool
    sizes: list[list[int]]
    state: str  # entered (scheduled), started, completed; waiting: see `settle`
    created: float  # time.time() when the rank entered it

    def text(self, groups: dict[str, tuple[str, list[int]]]) -> str:
        """`all_reduce [[1024]] over dp (ranks 0,1) seq 12, entered`."""
        desc, ranks = groups.get(self.group, ("", []))
        over = f"{desc or 'group ' + self.group} (ranks {','.join(map(str, ranks)) or '?'})"
        return f"{self.op} {self.sizes} over {over} seq {self.seq}, {self.state}"


@dataclass(frozen=True)
class Trace:
    rank: int
    tag: str  # the launch (distributed/progress.launch_tag)
    dumped: float
    groups: dict[str, tuple[str, list[int]]]  # name: (description, global ranks)
    entries: list[Entry]  # oldest first


def _entry(e: dict) -> Entry:
    """torch's JSON entry (version 2.10) as an `Entry`; gloo leaves `state` scheduled, and a
    completed collective shows as `retired`."""
    state = e.get("state", "scheduled")
    if e.get("retired") or state == "completed":
        state = "completed"
    op = str(e.get("profiling_name", "?")).split(":", 1)[-1]
    return Entry(
        op, str(e.get("process_group", ["?"])[0]),
        int(e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id", -1)),
        bool(e.get("is_p2p")), e.get("input_sizes", []),
        "entered" if state == "scheduled" else state, e.get("time_created_ns", 0) / 1e9,
    )  # fmt: skip


def dump(run_dir: str | None, rank: int) -> str | None:
    """Write this rank's trace to `trace_path`; its path, or None (no run.dir, nothing recorded,
    or the file could not be written: a dump must never hide the error that called it)."""
    if not run_dir:
        return None
    try:
        raw = flight_recorder_trace()
        groups = {n: [d, r] for n, (d, r) in process_group_ranks().items()}
        out = {"rank": rank, "tag": launch_tag(), "dumped": time.time(), "groups": groups,
               "entries": [_entry(e).__dict__ for e in raw.get("entries", [])]}  # fmt: skip
        path = trace_path(run_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(out, f)
        os.replace(f"{path}.tmp", path)
        return path
    except (OSError, RuntimeError, ValueError):
        return None


def read_traces(run_dir: str, tag: str | None = None) -> dict[int, Trace]:
    """{rank: trace} of the `rank<R>.fr.json` files in `run_dir/progress` (of launch `tag` when
    given); JSON only, a file that does not parse is skipped."""
    folder, out = os.path.join(run_dir, "progress"), {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}
    for name in names:
        if not (name.startswith("rank") and name.endswith(".fr.json")):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                d = json.load(f)
            trace = Trace(
                int(d["rank"]), str(d["tag"]), float(d["dumped"]),
                {str(n): (str(v[0]), [int(r) for r in v[1]]) for n, v in d["groups"].items()},
                [Entry(**e) for e in d["entries"]],
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        if tag is None or trace.tag == tag:
            out[trace.rank] = trace
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Gap:
    """A collective of `group` that did not complete: the ranks that entered it and wait in it,
    the ranks whose trace ends before it, and the ranks that left no trace (stopped or died)."""

    group: str
    desc: str
    ranks: list[int]
    seq: int
    entry: Entry  # as the first rank that entered it recorded it
    waiting: list[int]
    missing: list[int]
    untraced: list[int]


def first_gap(traces: dict[int, Trace]) -> Gap | None:
    """The first collective (by the time the first rank entered it) that some rank of its group
    never entered, or that no rank saw complete; None when every recorded collective matches."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for trace in traces.values():
        groups.update(trace.groups)
    gaps = [g for name, (desc, ranks) in groups.items() if (g := _gap(traces, name, desc, ranks))]
    return min(gaps, key=lambda g: g.entry.created, default=None)


def _gap(traces: dict[int, Trace], name: str, desc: str, ranks: list[int]) -> Gap | None:
    """The gap of one group: after the lowest sequence id its traced ranks all reached."""
    mine = {
        r: {e.seq: e for e in traces[r].entries if e.group == name and not e.p2p}
        for r in ranks
        if r in traces
    }
    if len(ranks) < 2 or not mine:
        return None
    last = {r: max(entries, default=0) for r, entries in mine.items()}
    low, high = min(last.values()), max(last.values())
    seq = low + 1 if high > low else low  # equal: the last one, if it never completed
    entered = sorted(r for r, s in last.items() if s >= seq and seq in mine[r])
    if not entered:
        return None
    waiting = [r for r in entered if mine[r][seq].state != "completed"]
    untraced = [r for r in ranks if r not in traces]
    if high == low and not waiting:
        return None
    first = min((mine[r][seq] for r in entered), key=lambda e: e.created)
    missing = sorted(r for r, s in last.items() if s < seq)
    return Gap(name, desc, ranks, seq, first, waiting, missing, untraced)


def settle(trace: Trace, record: Record | None) -> Trace:
    """`trace` with the collectives its rank entered after it began the wait it gave up in
    marked `waiting`, from its progress `record`: under gloo (torch 2.13) a collective that
    timed out can show as retired, and completed, in the dump (the work's end races the dump)."""
    if record is None or record.state != WAITING or record.wait.startswith(P2P):
        return trace
    entries = [
        replace(e, state="waiting") if e.created >= record.wait_since and not e.p2p else e
        for e in trace.entries
    ]
    return replace(trace, entries=entries)


def report(run_dir: str, records: dict[int, Record]) -> list[str]:
    """tools/diagnose.py's lines: each rank's last collective entered, then the first collective
    some rank never entered; without one, the ranks the progress `records` show waiting in a
    send or receive (which gloo does not record)."""
    tag = max(records.values(), key=lambda r: r.beat).tag if records else None
    traces = {k: settle(t, records.get(k)) for k, t in read_traces(run_dir, tag).items()}
    if not traces:
        return []
    groups: dict[str, tuple[str, list[int]]] = {}
    for trace in traces.values():
        groups.update(trace.groups)
    lines = [f"flight recorder: {len(traces)} traces (rank<R>.fr.json)"]
    for rank, trace in traces.items():
        last = trace.entries[-1].text(groups) if trace.entries else "none recorded"
        lines.append(f"rank {rank} last entered {last}")
    gap = first_gap(traces)
    if gap is not None:
        return lines + [gap_line(gap, groups)]
    p2p = [  # the ranks that gave up (they dumped) in a send or receive
        r
        for k, r in records.items()
        if k in traces and r.state == WAITING and r.wait.startswith(P2P)
    ]
    if p2p:
        waits = "; ".join(f"rank {r.rank} {r.where()}" for r in p2p)
        return lines + [f"every recorded collective matches; waiting in send/recv: {waits} "
                        "(not in gloo's flight recorder: from the progress records)"]  # fmt: skip
    return lines + ["every recorded collective matches"]


def gap_line(gap: Gap, groups: dict[str, tuple[str, list[int]]]) -> str:
    """`first collective some rank never entered: all_reduce [[8]] over ... seq 9, entered;
    rank 1 never entered it (no trace: stopped or died); waiting in it: rank 0`."""
    who = [_ranks(gap.missing) + " never entered it"] if gap.missing else []
    if gap.untraced:
        who.append(_ranks(gap.untraced) + " never entered it (no trace: stopped or died)")
    text = "; ".join(who) or "every rank entered it (a mismatch in op or sizes)"
    return (
        f"first collective some rank never entered: {gap.entry.text(groups)}; {text}; "
        f"waiting in it: {_ranks(gap.waiting) if gap.waiting else 'none'}"
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
