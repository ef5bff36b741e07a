"""Expert parallelism: a mixture-of-experts layer's experts sharded over ep ranks of the
data-parallel group, tokens exchanged by all-to-all (docs/moe.md)."""
