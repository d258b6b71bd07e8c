"""Paged attention for XLA:CPU as a C++ custom call (XLA FFI): what the engine serves with on a CPU.

The Pallas kernels only compile for GPUs, and the jnp reference pays XLA:CPU's fixed cost per
op on every gather and small dot of its fixed-shape loop. This kernel (`paged_attention.cc`)
keeps the reference's contract and loops over the real tokens and keys only. It is compiled
once per machine with the system's C++ compiler into a cache folder (`build.py`) and
registered with XLA as an FFI target; where it cannot be built, `kernel_problem()` says why and
the engine serves with the jnp reference instead.
"""

from kernels_cpu.attention import (
    build_hash,
    kernel_problem,
    kernel_registered,
    ragged_paged_attention_cpu,
    register_in_background,
    registration_deferred,
    write_kv_and_attend_cpu,
)

__all__ = [
    "build_hash",
    "kernel_problem",
    "kernel_registered",
    "ragged_paged_attention_cpu",
    "register_in_background",
    "registration_deferred",
    "write_kv_and_attend_cpu",
]
