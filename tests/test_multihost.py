"""Multi-host on one machine: 2 processes x 2 virtual CPU devices (gloo collectives, a loopback
coordinator), TP=4 over both. Greedy outputs equal transformers', the pool spans both processes,
and a worker whose leader dies ends with an error within seconds.

One run (about a minute on 2 cores): process 0 (multihost_leader.py) serves and prints its
findings, then stays up until this test SIGKILLs it; process 1 is `cbjax worker`. A normal exit of
the leader (it tells the worker to stop, exit status 0) is not covered here: a second run would
double the test's time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multihost_options import MAX_TOKENS, prompts, worker_flags
from test_engine import hf_greedy
from tiny_checkpoint import make_tiny_checkpoint

TESTS = Path(__file__).parent
DEAD_LEADER_BOUND_S = 30  # heartbeat timeout 10 s; the collective itself fails at once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    hf_dir, ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("multihost"), "llama")  # 4 heads, 2 KV heads
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",  # virtual CPU devices by design, also on a GPU host
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "cbjax.cli", "worker", "--model", str(ckpt), "--coordinator", coordinator,
         "--num-processes", "2", "--process-id", "1", *worker_flags()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    leader = subprocess.Popen(
        [sys.executable, str(TESTS / "multihost_leader.py"), str(ckpt), coordinator, "stay"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        result_line, deadline = None, time.monotonic() + 240
        while result_line is None and time.monotonic() < deadline:
            line = leader.stdout.readline()
            if not line:
                break
            if line.startswith("RESULT "):
                result_line = line
        assert result_line is not None, leader.stderr.read()[-4000:] if leader.poll() is not None else "no result"
        findings = json.loads(result_line.removeprefix("RESULT "))
        assert worker.poll() is None, "the worker must still serve while the leader lives"
        os.kill(leader.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            worker.wait(timeout=DEAD_LEADER_BOUND_S)
        except subprocess.TimeoutExpired:
            pass
        findings["worker_exit_s"] = time.monotonic() - killed
        findings["worker_returncode"] = worker.poll()
        findings["worker_stderr"] = worker.stderr.read()[-4000:] if worker.poll() is not None else ""
        findings["expected"] = [hf_greedy(hf_dir, prompt, MAX_TOKENS) for prompt in prompts()]
        return findings
    finally:
        for process in (leader, worker):  # only the processes this test started, by pid
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def test_two_processes_tp4_greedy_equals_transformers(run):
    # Prompts of 60/45/37 tokens are prefilled in chunks of 32, and the 20-block pool preempts.
    assert run["token_ids"] == run["expected"]
    assert run["num_preemptions"] > 0


def test_pool_spans_both_processes_devices(run):
    # 4 KV heads after repetition (2 heads x 2), one per device; process 0 holds two of the four.
    assert run["pool_shape"] == [4, 20, 8, 16]
    assert run["pool_local_shard_shapes"] == [[1, 20, 8, 16]]
    assert sorted({d.split(":")[0] for d in run["pool_devices"]}) == ["0", "1"] and len(run["pool_devices"]) == 4


def test_worker_whose_leader_dies_exits_with_error_in_bounded_time(run):
    assert run["worker_returncode"] not in (None, 0), "the worker hung or exited cleanly after its leader died"
    assert run["worker_exit_s"] < DEAD_LEADER_BOUND_S
    assert "Gloo" in run["worker_stderr"] or "heartbeat" in run["worker_stderr"] or "unhealthy" in run["worker_stderr"]
