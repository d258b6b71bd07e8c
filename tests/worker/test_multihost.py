"""Multi-host on one machine: 2 processes x 2 virtual CPU devices (gloo collectives, a loopback
coordinator), TP=4 over both. Greedy outputs equal transformers', the pool spans both processes,
and a dead peer ends the survivor with a clear error within seconds, either way round.

Two runs (about 40 s each on 2 cores): in each, process 0 (multihost_leader.py) serves and prints
its findings while process 1 is `cbjax worker`. In the first the leader then idles until this
test SIGKILLs it (the worker must exit with an error); in the second it keeps serving and the
test SIGKILLs the worker mid-step (the leader's step must raise PeerLostError, and the process
end). A normal exit of the leader (it tells the worker to stop, exit status 0) is not covered
here: a third run would cost another 40 s.
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
from engine_helpers import hf_greedy
from tiny_checkpoint import make_tiny_checkpoint
from xla_flags import with_host_devices

from cbjax.worker.distributed.multihost import PEER_LOST_EXIT_STATUS

TESTS = Path(__file__).parents[1]
DEAD_PEER_BOUND_S = 20  # the collectives fail at once; jax.distributed's heartbeat timeout is 10 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(ckpt: Path, leader_mode: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Process 1 (`cbjax worker`) and process 0 (multihost_leader.py in `leader_mode`), both started."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        XLA_FLAGS=with_host_devices(2),
        JAX_PLATFORMS="cpu",  # virtual CPU devices by design, also on a GPU host
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "cbjax", "worker", "--model", str(ckpt), "--coordinator", coordinator,
         "--num-processes", "2", "--process-id", "1", *worker_flags()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    leader = subprocess.Popen(
        [sys.executable, str(TESTS / "multihost_leader.py"), str(ckpt), coordinator, leader_mode],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return leader, worker


def read_line(process: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The first line of `process`'s stdout that starts with `prefix`, without it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.removeprefix(prefix)
    pytest.fail(f"no {prefix!r} line; stderr: {process.stderr.read()[-4000:] if process.poll() is not None else ''}")


def kill_and_wait(victim: subprocess.Popen, survivor: subprocess.Popen) -> dict:
    """SIGKILL `victim`; how long `survivor` took to exit (None: still running after the bound)."""
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        survivor.wait(timeout=DEAD_PEER_BOUND_S)
    except subprocess.TimeoutExpired:
        pass
    return {"exit_s": time.monotonic() - killed, "returncode": survivor.poll(), "killed": killed}


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:  # only the processes this test started, by pid
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("multihost"), "llama")  # 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def run(checkpoint) -> dict:
    """Serve, check, then SIGKILL the idle leader: the worker, waiting for the next step, must fail."""
    hf_dir, ckpt = checkpoint
    leader, worker = start_pair(ckpt, "stay")
    try:
        findings = json.loads(read_line(leader, "RESULT ", 240))
        assert worker.poll() is None, "the worker must still serve while the leader lives"
        death = kill_and_wait(leader, worker)
        findings["worker_exit_s"], findings["worker_returncode"] = death["exit_s"], death["returncode"]
        findings["worker_stderr"] = worker.stderr.read()[-4000:] if worker.poll() is not None else ""
        findings["expected"] = [hf_greedy(hf_dir, prompt, MAX_TOKENS) for prompt in prompts()]
        return findings
    finally:
        stop(leader, worker)


@pytest.fixture(scope="module")
def dead_worker_run(checkpoint) -> dict:
    """Serve without pause, SIGKILL the worker mid-step: the leader's step must raise, and the process end."""
    leader, worker = start_pair(checkpoint[1], "serve")
    try:
        read_line(leader, "RESULT ", 240)
        time.sleep(0.5)  # into the next generate call, whose steps run back to back
        death = kill_and_wait(worker, leader)
        message = read_line(leader, "PEER_LOST ", 1) if death["returncode"] == PEER_LOST_EXIT_STATUS else ""
        return {**death, "message": message, "stderr": leader.stderr.read()[-4000:] if leader.poll() is not None else ""}
    finally:
        stop(leader, worker)


def test_two_processes_tp4_greedy_equals_transformers(run):
    # Prompts of 60/45/37 tokens are prefilled in chunks of 32, and the 20-block pool preempts.
    assert run["token_ids"] == run["expected"]
    assert run["num_preemptions"] > 0
    # The first prompt again, four times: from the prefix cache, its block-table entries sent ahead of the step.
    assert run["repeated_token_ids"] == [run["expected"][0]] * 4
    cached = run["repeated_cached_tokens"]  # (what the small pool kept of the prompt's 7 full blocks)
    assert len(set(cached)) == 1 and cached[0] > 0 and run["table_writes"] > 0


def test_pool_spans_both_processes_devices(run):
    # 4 KV heads after repetition (2 heads x 2), one per device; process 0 holds two of the four.
    assert run["pool_shape"] == [4, 2 * 20, 8, 16]  # 2 layers' 20 blocks each, in one K array
    assert run["pool_local_shard_shapes"] == [[1, 2 * 20, 8, 16]]
    assert sorted({d.split(":")[0] for d in run["pool_devices"]}) == ["0", "1"] and len(run["pool_devices"]) == 4


def ended_by_jax_distributed(returncode: int | None, stderr: str) -> bool:
    """Whether jax.distributed noticed the dead peer before a step's collectives did (a race, seen
    in CI both ways round: its error poll or heartbeats win under load): then jax's own message
    ends the process with SIGABRT (worker/distributed/multihost.py's docstring)."""
    if returncode != -signal.SIGABRT:
        return False
    assert "JAX distributed service detected fatal errors" in stderr and "another task died" in stderr, stderr
    return True


def test_worker_whose_leader_dies_exits_with_clear_error_in_bounded_time(run):
    assert run["worker_exit_s"] < DEAD_PEER_BOUND_S
    stderr = run["worker_stderr"]
    if ended_by_jax_distributed(run["worker_returncode"], stderr):
        return
    assert run["worker_returncode"] == PEER_LOST_EXIT_STATUS, stderr
    assert "cbjax worker: process 1 of 2 lost a peer during a step" in stderr
    assert "restart every process" in stderr


def test_leader_whose_worker_dies_mid_serving_raises_clear_error_in_bounded_time(dead_worker_run):
    assert dead_worker_run["exit_s"] < DEAD_PEER_BOUND_S
    if ended_by_jax_distributed(dead_worker_run["returncode"], dead_worker_run["stderr"]):
        return
    assert dead_worker_run["returncode"] == PEER_LOST_EXIT_STATUS, dead_worker_run["stderr"]
    message = dead_worker_run["message"]
    assert message.startswith("process 0 of 2 lost a peer during a step"), dead_worker_run["stderr"]
    assert "another process of this multi-host engine died" in message and "restart every process" in message
