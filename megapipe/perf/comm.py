"""Collectives and point-to-point transfers priced on the link they cross.

Ranks sit on the grid of distributed/mesh.py: (pp, dp, cp, tp) with tp varying fastest, so the
stride of an axis is the product of the faster axes' sizes (tp 1, cp tp, dp tp·cp, pp
tp·cp·dp); node n holds ranks n·G .. n·G+G−1. A group whose members share one node talks over
NVLink/NVSwitch; one spanning nodes crosses the network.

Algorithm: NCCL's ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"; the NCCL default at large messages). For a group of n ranks and a
tensor of S bytes, with α the per-step latency and β the per-GPU bandwidth of the slowest hop:

    all-reduce       2(n−1)·α + 2(n−1)/n · S/β     (reduce-scatter then all-gather)
    reduce-scatter    (n−1)·α +  (n−1)/n · S/β     (S: the full input)
    all-gather        (n−1)·α +  (n−1)/n · S/β     (S: the full output)
    p2p                      α +          S/β
    all-to-all        (n−1)·α +  (n−1)/n · S/β     (S: what one rank sends, its own share
                                                   included; pairwise exchange, as NCCL's
                                                   send/recv all-to-all)

Expert parallelism's all-to-all (parallel/expert/all_to_all.py) runs inside an ep group: ep
consecutive dp ranks (distributed/mesh.py), so rank stride tp·cp; with balanced routing each
rank keeps 1/ep of its rows and sends (ep−1)/ep of them, and receives as many.

Bandwidth of a ring that spans nodes: every GPU of a node runs the same collective at once in
its own group (all tp ranks reduce their dp groups together, every stage sends its activations
together), so the node's NICs are shared evenly: a group with g members on each node crosses
between nodes with g GPUs' share of the NICs (NCCL runs one ring channel per NIC), and inside
the node over NVLink: β = min(g · network/G, NVLink) (network/G when g = 1).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache

from megapipe.perf.cluster import Cluster, Link

AXES = ("pp", "dp", "cp", "tp")  # distributed/mesh.py's grid order, tp fastest


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of one ring collective `kind` (all_reduce, reduce_scatter, all_gather) of
    `nbytes` (the full tensor) over `n` ranks on `link`."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[kind]
    return steps * link.latency + steps / n * nbytes / link.bandwidth


def p2p_time(nbytes: float, link: Link) -> float:
    """Seconds of one point-to-point transfer of `nbytes`."""
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0


def strides(shape: tuple[int, int, int, int]) -> dict[str, int]:
    """Rank stride of each axis of the (pp, dp, cp, tp) grid (mesh.rank_grid's layout)."""
    out, step = {}, 1
    for axis, size in reversed(list(zip(AXES, shape))):
        out[axis] = step
        step *= size
    return out


def groups(shape: tuple[int, int, int, int], axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that varies `axes` with the other coordinates fixed: tp groups,
    dp groups, the dp × cp replica group, ..."""
    sizes, step = dict(zip(AXES, shape)), strides(shape)
    inside = [0]
    for axis in axes:
        inside = [r + i * step[axis] for r in inside for i in range(sizes[axis])]
    bases = [0]
    for axis in AXES:
        if axis not in axes:
            bases = [r + i * step[axis] for r in bases for i in range(sizes[axis])]
    return [[b + r for r in inside] for b in bases]


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds of one all-to-all over `n` ranks on `link`, each rank holding `nbytes` to spread
    evenly (module doc): it sends and receives (n−1)/n of them."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def ep_groups(shape: tuple[int, int, int, int], ep: int) -> list[list[int]]:
    """Every ep group: ep consecutive dp ranks of one dp block (distributed/mesh.py)."""
    stride = strides(shape)["dp"]
    return [
        [r + i * stride for i in range(ep)]
        for members in groups(shape, ("dp",))
        for r in members[::ep]
    ]


@lru_cache(maxsize=4096)
def _group_link(shape, axes, gpus_per_node, cluster) -> Link:
    return _worst_link(groups(shape, axes), gpus_per_node, cluster)


def _worst_link(members_of: list[list[int]], gpus_per_node: int, cluster) -> Link:
    nvlink = cluster.nvlink
    worst = None
    for members in members_of:
        per_node = Counter(r // gpus_per_node for r in members)
        if len(per_node) == 1:
            link = nvlink
        else:
            g = min(per_node.values())
            net = cluster.network(g)
            link = net if g == 1 else Link("network", min(net.bandwidth, nvlink.bandwidth),
                                           net.latency)  # fmt: skip
        if worst is None or (link.bandwidth, -link.latency) < (worst.bandwidth, -worst.latency):
            worst = link
    return worst


@lru_cache(maxsize=4096)
def _cp_split_links(shape, k, gpus_per_node, cluster) -> tuple[Link, Link]:
    a2a, ring = [], []
    for members in groups(shape, ("cp",)):  # distributed/mesh.cp_split_ranks' layout
        a2a += [members[g : g + k] for g in range(0, len(members), k)]
        ring += [members[j::k] for j in range(k)]
    return _worst_link(a2a, gpus_per_node, cluster), _worst_link(ring, gpus_per_node, cluster)


def cp_split_links(cluster: Cluster, shape: tuple[int, int, int, int], k: int) -> tuple[Link, Link]:
    """Hybrid cp's (a2a link, ring link): the slowest group of k adjacent cp ranks (stride tp:
    NVLink while k·tp fits a node) and the slowest ring over the cp/k groups."""
    return _cp_split_links(tuple(shape), k, cluster.gpus_per_node, cluster)


def hsdp_groups(shape: tuple[int, int, int, int], s: int, ep: int = 1) -> tuple[list, list, list]:
    """HSDP's (shard groups, expert shard groups, replicate groups) as distributed/mesh.py
    makes them: each dp × cp group cut into dp/s blocks of s consecutive dp ranks with every cp
    rank; the experts' the ranks of one ep rank (dp mod ep) in a block; the dp/s ranks at one
    place of every block (same dp mod s, same cp)."""
    step, dp, cp = strides(shape), shape[1], shape[2]
    out: tuple[list, list, list] = ([], [], [])
    for members in groups(shape, ("dp", "cp")):
        kinds = (defaultdict(list), defaultdict(list), defaultdict(list))
        for r in members:
            d, c = (r // step["dp"]) % dp, (r // step["cp"]) % cp
            for by, key in zip(kinds, (d // s, (d // s, d % ep), (d % s, c))):
                by[key].append(r)
        for kind, by in zip(out, kinds):
            kind.extend(by.values())
    return out


@lru_cache(maxsize=4096)
def _hsdp_links(shape, s, ep, gpus_per_node, cluster) -> tuple[Link, Link, Link]:
    shard, experts, replicate = hsdp_groups(shape, s, ep)
    return tuple(_worst_link(g, gpus_per_node, cluster) for g in (shard, experts, replicate))


def hsdp_links(cluster: Cluster, shape: tuple[int, int, int, int], s: int, ep: int = 1):
    """The links of HSDP's slowest shard group, expert shard group and replicate group, by the
    rule of `group_link`."""
    return _hsdp_links(tuple(shape), s, ep, cluster.gpus_per_node, cluster)


def group_link(cluster: Cluster, shape: tuple[int, int, int, int], axes: tuple[str, ...]) -> Link:
    """The link of the slowest group along `axes` (they all run at once and wait for each
    other): NVLink when each group sits in one node, else the network share (module doc)."""
    return _group_link(tuple(shape), tuple(axes), cluster.gpus_per_node, cluster)


@lru_cache(maxsize=4096)
def _ep_link(shape, ep, gpus_per_node, cluster) -> Link:
    worst = None
    for members in ep_groups(shape, ep):
        per_node = Counter(r // gpus_per_node for r in members)
        if len(per_node) == 1:
            link = cluster.nvlink
        else:  # the member with the fewest group-mates on its node sends the most off it
            g = min(per_node.values())
            own = cluster.network(1)
            bandwidth = min(own.bandwidth * (ep - 1) / (ep - g), cluster.nvlink.bandwidth)
            link = Link("network", bandwidth, own.latency)
        if worst is None or (link.bandwidth, -link.latency) < (worst.bandwidth, -worst.latency):
            worst = link
    return worst


def ep_link(cluster: Cluster, shape: tuple[int, int, int, int], ep: int) -> Link:
    """The link of the slowest ep group's all-to-all. Unlike a ring (one stream crosses each
    node boundary, carried on g NICs), every member of an all-to-all sends its own rows off
    the node: its (ep−g)/ep share leaves through its own NIC (network/G; the node's other
    GPUs run their own ep groups' all-to-alls at once) while the rows for its g−1 node-mates
    cross NVLink beside it. As a Link for all_to_all_time's (ep−1)/ep · S: β = network/G ·
    (ep−1)/(ep−g), at most NVLink (g = 1: network/G, as group_link)."""
    return _ep_link(tuple(shape), ep, cluster.gpus_per_node, cluster)


def expert_replica_groups(shape: tuple[int, int, int, int], ep: int) -> list[list[int]]:
    """Every expert-replica group (Megatron-Core's expert data-parallel group): the dp/ep · cp
    ranks of one dp × cp group with the same ep rank (dp index mod ep), which hold the same
    experts and sum their grads (parallel/data/reducer.py)."""
    stride, dp = strides(shape)["dp"], shape[1]
    out = []
    for members in groups(shape, ("dp", "cp")):
        for e in range(ep):
            out.append([r for r in members if (r // stride) % dp % ep == e])
    return out


@lru_cache(maxsize=4096)
def _replica_link(shape, ep, gpus_per_node, cluster) -> Link:
    return _worst_link(expert_replica_groups(shape, ep), gpus_per_node, cluster)


def expert_replica_link(cluster: Cluster, shape: tuple[int, int, int, int], ep: int) -> Link:
    """The link of the slowest expert-replica group, by the rule of `group_link`."""
    return _replica_link(tuple(shape), ep, cluster.gpus_per_node, cluster)


@lru_cache(maxsize=4096)
def _p2p_link(shape, src, dst, gpus_per_node, cluster) -> Link:
    step = strides(shape)["pp"]
    crosses = any(
        (src * step + r) // gpus_per_node != (dst * step + r) // gpus_per_node for r in range(step)
    )
    return cluster.network(1) if crosses else cluster.p2p


def p2p_link(cluster: Cluster, shape: tuple[int, int, int, int], src: int, dst: int) -> Link:
    """The link between pp ranks `src` and `dst`: each of the dp·cp·tp pairs sends at once, one
    GPU's share of the NICs when any pair crosses nodes, else NVLink (a measured profile's own
    point-to-point link where it has one: cluster.Cluster.p2p)."""
    return _p2p_link(tuple(shape), src, dst, cluster.gpus_per_node, cluster)
