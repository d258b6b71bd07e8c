"""How many CPUs `cbjax serve`'s device steps use on a CPU host: all but `--num-reserved-cpus`, as
vLLM-CPU reserves a CPU for its front end and binds its compute threads to the rest.

XLA:CPU sizes its intra-op thread pool from the CPUs the process may use when its backend starts,
and splits every dot and kernel of a step over that pool. When other processes want the same cores
(a shared machine, or the server's own event loop and its clients), a step waits at every split for
its slowest thread, and the server's steps slowed down far more than vLLM's (BENCHMARKS.md section
9). So the backend is started while the process sees only the compute CPUs, after which every thread
may run on any CPU again; with one compute CPU the dots also stay on the calling thread.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def limit_compute_threads(num_reserved_cpus: int) -> int:
    """Start JAX's backends with an XLA:CPU pool of (usable CPUs - num_reserved_cpus) threads, at least
    one; the number of compute threads. Call it before anything touches a JAX device."""
    if num_reserved_cpus < 0:
        raise ValueError(f"--num-reserved-cpus is {num_reserved_cpus}; give 0 (use every CPU) or more")
    if not hasattr(os, "sched_getaffinity"):  # not Linux: XLA picks its pool as usual
        return os.cpu_count() or 1
    cpus = sorted(os.sched_getaffinity(0))
    num_compute = max(1, len(cpus) - num_reserved_cpus)
    if num_compute == len(cpus):
        return num_compute
    if num_compute == 1:  # no pool to split the dots over; keep them on the step's own thread
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
    import jax

    os.sched_setaffinity(0, cpus[:num_compute])
    try:
        jax.devices()  # starts the backends: the CPU pool gets num_compute threads
    finally:
        for thread_id in os.listdir("/proc/self/task"):  # the pool's threads too: none stays pinned
            try:
                os.sched_setaffinity(int(thread_id), cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    logger.info("XLA:CPU computes on %d of %d CPUs (%d reserved for the front end)", num_compute, len(cpus),
                num_reserved_cpus)
    return num_compute
