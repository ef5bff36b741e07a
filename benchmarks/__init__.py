"""Benchmarks and validation harnesses over one shared harness (harness.py): run from the repo
root with the project installed, `python -m benchmarks.bench NAME` (docs/architecture.md,
"benchmarks/"). Not part of the installed package; the library never imports or runs them."""
