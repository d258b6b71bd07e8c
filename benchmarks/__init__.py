"""Developers' benchmarks and A/B experiments: not installed with cbjax, run from a checkout.

    python -m benchmarks.kernels --dry-run      # from the repository root

What users run stays in the package (`cbjax bench throughput | serve | prefill-stall |
kv-capacity | host`, `python -m cbjax.bench.peers`); what lives here reaches into the engine's
parts (runner, scheduler, kernels) to time one of them, or compares two variants of the code.
"""
