"""A store namespace of its own for each start of the workers, so torchrun can restart them.

torchrun's c10d rendezvous hands its workers a TCPStore that the agent hosts
(TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across the restarts of `--max-restarts`. Every
key the groups of one start wrote is still there when the restarted workers create theirs, under
the same names (gloo's addresses are `default_pg/0//cpu//0/<rank>`, and so on for each group), so
a rank can read a dead peer's address, connect to nothing and fail
(`Gloo connectFullMesh failed ... Connect timeout`; pytorch/pytorch#135712). torch's own remedy,
a prefix from TORCHELASTIC_RESTART_COUNT, cannot name a start either: each agent counts only its
own restarts, so after one node's failure the nodes disagree (pytorch/pytorch#108158).

`attempt_store` prefixes every key of this start with a token no earlier start used. Global
rank 0 draws it and hands it to the others through a handshake in which no stale key can pass
for a fresh one: each other rank asks under a nonce of its own (numbered by an atomic counter),
rank 0 answers every request it finds, old ones included (nobody waits on those), until every
rank has acknowledged under the new token, a key no earlier start could have written.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

POLL_S = 0.01  # rank 0's pause between looks at the requests (a few per start)


def agent_store_in_use() -> bool:
    """Whether the workers share a store that torchrun's agent keeps across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The agent's store (MASTER_ADDR:MASTER_PORT) under a prefix fresh for this start."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timeout,
    )  # fmt: skip
    handshake = dist.PrefixStore("megapipe/attempts", store)
    if rank == 0:
        token = _hand_out(handshake, world, timeout.total_seconds())
    else:
        token = _ask(handshake, timeout)
    return dist.PrefixStore(f"megapipe/{token}", store)


def _ask(store: dist.Store, timeout: datetime.timedelta) -> str:
    """A rank other than 0: ask under a fresh nonce, wait for the answer, acknowledge it."""
    nonce = uuid.uuid4().hex
    number = store.add("requests", 1)
    store.set(f"request/{number}", nonce)
    store.wait([f"answer/{nonce}"], timeout)
    token = store.get(f"answer/{nonce}").decode()
    store.add(f"acks/{token}", 1)
    return token


def _hand_out(store: dist.Store, world: int, timeout_s: float) -> str:
    """Rank 0: answer every request with a fresh token until world - 1 ranks acknowledged it.
    A request whose asker died before writing its nonce stays pending, never waited on."""
    token, seen, pending = uuid.uuid4().hex, 0, set()
    deadline = time.monotonic() + timeout_s
    while store.add(f"acks/{token}", 0) < world - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"Timed out after {timeout_s:.0f} s handing the store prefix to the other ranks"
            )  # a rank died or never started: peer_lost's one line
        latest = store.add("requests", 0)
        pending.update(range(seen + 1, latest + 1))
        seen = latest
        for number in sorted(pending):
            if store.check([f"request/{number}"]):
                nonce = store.get(f"request/{number}").decode()
                store.set(f"answer/{nonce}", token)
                pending.discard(number)
        time.sleep(POLL_S)
    return token
