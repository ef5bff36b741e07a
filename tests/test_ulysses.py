"""Ulysses (parallel/context/ulysses.py) without process groups: the kv-head repeat rule gives
every cp rank's query heads the kv heads they use, with a uniform grouping; the variant names
are the config's. Its parity under gloo is tests/test_parity_cp.py's and test_document_mask.py's.
"""

from types import SimpleNamespace

import pytest

from megapipe.config.checks import CP_COMMS
from megapipe.parallel.context.ulysses import kv_repeats
from megapipe.parallel.context.variants import CP_VARIANTS, cp_variant


def kv_heads_seen(q_heads: int, kv_heads: int, cp: int, rank: int) -> list[int]:
    """The original kv head each of `rank`'s query heads is attended with after the repeat and
    the all-to-all's even split: local query i uses local kv i // (local groups)."""
    rep = kv_repeats(q_heads, kv_heads, cp)
    copies = [i // rep for i in range(kv_heads * rep)]  # repeat_interleave: consecutive copies
    mine = copies[rank * len(copies) // cp : (rank + 1) * len(copies) // cp]
    group = (q_heads // cp) // len(mine)
    return [mine[i // group] for i in range(q_heads // cp)]


def test_every_rank_gets_the_kv_heads_its_queries_use():
    cases = 0
    for cp in (2, 3, 4, 6, 8):
        for q_heads in range(cp, 49, cp):
            for kv_heads in (n for n in range(1, q_heads + 1) if q_heads % n == 0):
                g, rep = q_heads // kv_heads, kv_repeats(q_heads, kv_heads, cp)
                assert g % rep == 0 and kv_heads * rep % cp == 0  # uniform groups, even split
                for r in range(cp):
                    want = [j // g for j in range(r * q_heads // cp, (r + 1) * q_heads // cp)]
                    assert kv_heads_seen(q_heads, kv_heads, cp, r) == want, (q_heads, kv_heads)
                cases += 1
    assert cases > 100
    assert kv_repeats(8, 8, 4) == 1 and kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 1, 4) == 4


def test_query_heads_that_do_not_divide_by_cp_are_refused():
    with pytest.raises(ValueError, match="3 query heads on this tp rank must divide by cp=2"):
        kv_repeats(3, 1, 2)


def test_the_variants_are_the_configs_choices():
    """Every parallel.cp_comm the config accepts resolves to the variant of that name (hybrid
    takes its two sub-groups from the mesh)."""
    mesh = SimpleNamespace(cp_a2a_group="a2a", cp_ring_group="ring")
    assert [cp_variant(comm, mesh).name for comm in CP_COMMS] == list(CP_COMMS)
    assert set(CP_VARIANTS) < set(CP_COMMS)
