"""Developers' named benchmarks and the A/B harness: not installed with cbjax, run from a checkout.

    python -m benchmarks.NAME --help      # from the repository root; the index is benchmarks/README.md

What users run stays in the package (`cbjax bench throughput | serve | prefill-stall | kv-capacity |
host`, `python -m cbjax.bench.peers`); what lives here reaches into the engine's parts (runner, kernels,
compiled steps) to time one of them, or compares two commits (`python -m benchmarks.ab`).
"""
