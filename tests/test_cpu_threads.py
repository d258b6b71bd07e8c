"""`cbjax serve --num-reserved-cpus`: XLA:CPU's pool is one thread per CPU, less the reserved ones,
and no thread stays pinned afterwards (each case in a fresh process: the pool is made once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbjax.entrypoints.cpu_threads import limit_compute_threads

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, sys
from cbjax.entrypoints.cpu_threads import limit_compute_threads
if sys.argv[1] != "none":
    limit_compute_threads(int(sys.argv[1]))
import jax, jax.numpy as jnp
(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
tasks = os.listdir("/proc/self/task")
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
print(json.dumps({"pool": names.count("tf_XLAEigen"), "masks": [sorted(os.sched_getaffinity(int(t))) for t in tasks],
                  "xla_flags": os.environ.get("XLA_FLAGS", "")}))
"""


def probe(reserved: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(REPO), "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", PROBE, reserved], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs")
def test_reserving_a_cpu_leaves_the_xla_pool_one_thread_short_and_no_thread_pinned():
    cpus = sorted(os.sched_getaffinity(0))
    assert probe("none")["pool"] == len(cpus), "XLA makes one pool thread per usable CPU"
    limited = probe("1")
    assert limited["pool"] == len(cpus) - 1
    assert all(mask == cpus for mask in limited["masks"]), "every thread may run on every CPU again"
    one_thread = len(cpus) == 2
    assert ("--xla_cpu_multi_thread_eigen=false" in limited["xla_flags"]) == one_thread
    assert probe("0")["pool"] == len(cpus)


def test_a_negative_reservation_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"--num-reserved-cpus is -1; give 0"):
        limit_compute_threads(-1)
