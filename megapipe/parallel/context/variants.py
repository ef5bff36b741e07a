"""The attention's cp variant (`parallel.cp_comm`), resolved once into the object the model's
attention is built with (CPInfo.attention): the kv ring (ring.py), Ulysses' all-to-all
(ulysses.py) or the two nested (hybrid.py, over the mesh's cp sub-groups). All take the same
zigzag sequence shard and give the same result, with the layer's sliding window (`window`,
window.py) on global positions; they differ in what travels (docs/parallelism.md, Context
parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megapipe.parallel.context.hybrid import hybrid_attention
from megapipe.parallel.context.ring import ring_attention
from megapipe.parallel.context.ulysses import ulysses_attention


@dataclass(frozen=True)
class RingVariant:
    """K/V blocks around the ring, merged by log-sum-exp; `core` is not used (the ring runs its
    own block kernels)."""

    name: str = "ring"

    def __call__(
        self,
        q,
        k,
        v,
        group,
        core: Callable,
        dropout_p: float,
        documents=None,
        layout=None,
        window: int = 0,
    ):
        return ring_attention(
            q, k, v, group, dropout_p=dropout_p, documents=documents, layout=layout, window=window
        )


@dataclass(frozen=True)
class UlyssesVariant:
    """Sequence shards to head shards by all-to-all, `core` on whole sequences, and back. Every
    rank attends whole sequences over its heads, so its work is balanced by construction: no
    document `layout` (config checks keep parallel.cp_balance=position here)."""

    name: str = "a2a"

    def __call__(
        self,
        q,
        k,
        v,
        group,
        core: Callable,
        dropout_p: float,
        documents=None,
        layout=None,
        window: int = 0,
    ):
        assert layout is None, "cp_balance=documents: ring or hybrid (config checks)"
        return ulysses_attention(q, k, v, group, core, dropout_p, documents, window)


@dataclass(frozen=True)
class HybridVariant:
    """All-to-all inside `a2a_group`, the ring over `ring_group` (the mesh's cp sub-groups);
    the cp group it is called with is their product and is not used."""

    a2a_group: object
    ring_group: object
    name: str = "hybrid"

    def __call__(
        self,
        q,
        k,
        v,
        group,
        core: Callable,
        dropout_p: float,
        documents=None,
        layout=None,
        window: int = 0,
    ):
        return hybrid_attention(
            q, k, v, self.a2a_group, self.ring_group, dropout_p, documents, layout, window
        )


CP_VARIANTS = {"ring": RingVariant(), "a2a": UlyssesVariant()}


def cp_variant(comm: str, mesh=None):
    """The variant named by parallel.cp_comm (config checks keep the name one of these and
    "hybrid"); hybrid takes its groups from `mesh` (distributed/mesh.py, cp_split_ranks)."""
    if comm == "hybrid":
        return HybridVariant(mesh.cp_a2a_group, mesh.cp_ring_group)
    return CP_VARIANTS[comm]
