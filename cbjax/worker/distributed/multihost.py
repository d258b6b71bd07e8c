"""Several processes, one engine: jax.distributed multi-controller SPMD.

Every process loads its own shards of the weights and the KV pool (one mesh over all processes'
devices) and runs the same compiled steps. Process 0 (the leader) owns the scheduler, the
tokenizer and the front end; before each step it broadcasts one int32 buffer through JAX itself
(multihost_utils.broadcast_one_to_all, a psum over a tiny array): a control word, the bucket's
index and the step's packed inputs. The other processes (`cbjax worker`) only wait for that
buffer and run the step it names, until the control word says to stop.

A dead peer ends every process with an error, never a hang: a survivor in the step's collectives
fails at once when gloo/NCCL loses the connection (measured: within a second of a SIGKILL, either
way), which becomes a PeerLostError naming what happened and the fix; the leader's `step()`
raises it, a worker prints it. Such a process then exits with PEER_LOST_EXIT_STATUS as soon as
the interpreter exits, skipping jax.distributed's shutdown barrier (which would wait out the
heartbeat timeout for the dead peer, then abort with a C++ stack trace). A process that loses a
peer while outside a collective (an idle leader) is stopped by jax.distributed's heartbeats
(HEARTBEAT_TIMEOUT_S). So is a worker whose leader dies, when its error poll finds process 0's
coordination service gone before gloo/NCCL fails the step (a race: both happen at once), and a
leader whose worker dies while the leader is between steps or slowed down (seen on a loaded
machine: the heartbeats noticed first): jax logs
"Terminating process because the JAX distributed service detected fatal errors ... another task
died" and aborts. jax.distributed takes no callback to replace that abort from Python (the client
factory's callback receives a C++ status it cannot pass to Python: std::bad_cast, measured on jax
0.10). A leader that exits normally tells the workers to stop (exit status 0).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Int

if TYPE_CHECKING:
    from cbjax.config import EngineConfig
    from cbjax.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

RUN_STEP, SHUTDOWN = 1, 2  # the control word, the buffer's first int32
HEADER = 2  # control word, bucket index
# Short, so that a dead peer ends the others within seconds rather than jax's default 100 s.
HEARTBEAT_TIMEOUT_S = 10
INITIALIZATION_TIMEOUT_S = 120  # every process must have joined by then
SHUTDOWN_TIMEOUT_S = 10
PEER_LOST_EXIT_STATUS = 3  # the exit status of a process that lost a peer
# What XLA's collectives and jax.distributed say when a peer process is gone.
_PEER_LOSS_SIGNS = ("Gloo", "NCCL", "Connection", "connection", "heartbeat", "unhealthy", "coordination service")


class PeerLostError(RuntimeError):
    """Another process of the multi-host engine died or its connection broke: this engine cannot go on."""


def initialize(config: EngineConfig) -> None:
    """Join the processes of a multi-host engine (a no-op for one process); before any device is used."""
    if config.num_processes == 1:
        return
    if config.coordinator is None:
        raise ValueError(
            f"num_processes={config.num_processes} needs coordinator='HOST:PORT' (process 0's address, the same "
            "in every process)"
        )
    if not 0 <= config.process_id < config.num_processes:
        raise ValueError(
            f"process_id={config.process_id} is outside [0, num_processes={config.num_processes}); "
            "give each process its own id, 0 for the one that serves"
        )
    # XLA:CPU runs cross-process collectives only through gloo (tests and CPU hosts); GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=INITIALIZATION_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    logger.info(
        "process %d of %d joined %s: %d local devices, %d in all",
        config.process_id, config.num_processes, config.coordinator, jax.local_device_count(), jax.device_count(),
    )


class StepBroadcast:
    """The leader's and the workers' ends of the per-step buffer [control, bucket index, packed...]."""

    def __init__(self, packed_sizes: list[int]):
        self.packed_sizes = packed_sizes  # per program: the buckets in the runner's order, then write_table
        self.width = HEADER + max(packed_sizes)  # one shape, so the broadcast compiles once
        self.closed = False  # shut down, or a peer is lost: no more broadcasts

    def send_step(self, bucket_index: int, packed: Int[np.ndarray, "size"]) -> None:
        buffer = np.zeros(self.width, np.int32)
        buffer[:HEADER] = (RUN_STEP, bucket_index)
        buffer[HEADER : HEADER + packed.size] = packed
        multihost_utils.broadcast_one_to_all(buffer)

    def send_shutdown(self) -> None:
        """Tell every worker to exit (once; at interpreter exit at the latest)."""
        if self.closed:
            return
        self.closed = True
        buffer = np.zeros(self.width, np.int32)
        buffer[0] = SHUTDOWN
        multihost_utils.broadcast_one_to_all(buffer)

    def receive(self) -> tuple[int, Int[np.ndarray, "size"]] | None:
        """The next program's (index, packed inputs), or None when the leader shuts down."""
        buffer = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(self.width, np.int32)))
        control, bucket_index = int(buffer[0]), int(buffer[1])
        if control == SHUTDOWN:
            return None
        if control != RUN_STEP or not 0 <= bucket_index < len(self.packed_sizes):
            raise RuntimeError(
                f"step buffer with control word {control} and bucket {bucket_index} (of {len(self.packed_sizes)}): "
                "the leader runs another engine configuration; start every process with the same engine options"
            )
        return bucket_index, buffer[HEADER : HEADER + self.packed_sizes[bucket_index]]


_NO_PEERS = contextlib.nullcontext()  # reusable: entering it does nothing


def peer_failures(broadcast: StepBroadcast | None) -> contextlib.AbstractContextManager[None]:
    """Turn a collective that failed because a peer process is gone into a PeerLostError (no-op for one
    process: a shared null context, since a generator-based one costs microseconds twice a step)."""
    return _NO_PEERS if broadcast is None else _peer_failures(broadcast)


@contextlib.contextmanager
def _peer_failures(broadcast: StepBroadcast) -> Iterator[None]:
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if not any(sign in str(error) for sign in _PEER_LOSS_SIGNS):
            raise
        if not broadcast.closed:
            broadcast.closed = True  # a shutdown broadcast now would only fail again
            # Registered after jax's own exit hook, so it runs first and skips jax.distributed's shutdown.
            atexit.register(_exit_after_peer_loss)
        raise PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()} lost a peer during a step ({first_line}): "
            "another process of this multi-host engine died or its connection broke, and the engine cannot "
            "continue without it; restart every process (process 0 and each `cbjax worker`) with the same options"
        ) from error


def _exit_after_peer_loss() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT_STATUS)


def attach(runner: ModelRunner, config: EngineConfig) -> StepBroadcast | None:
    """Give a multi-host engine's runner its broadcast; on the leader it also stops the workers at exit."""
    if config.num_processes == 1:
        return None
    # Step buckets in the runner's order, then its write_table program (runner.write_table_index).
    broadcast = StepBroadcast([runner.packed_size(bucket) for bucket in runner.buckets] + [runner.write_table_packed_size])
    if config.process_id == 0:
        runner.step_broadcast = broadcast
        atexit.register(broadcast.send_shutdown)  # before jax.distributed's own exit hook, which runs later
    return broadcast


def serve_steps(runner: ModelRunner, broadcast: StepBroadcast) -> int:
    """A worker's loop: run each step the leader names until it shuts down; the number of steps run."""
    num_steps = 0
    with peer_failures(broadcast):
        while (step := broadcast.receive()) is not None:
            bucket_index, packed = step
            if bucket_index == runner.write_table_index:
                runner.write_table(packed)
            else:
                runner.launch(runner.buckets[bucket_index], packed)
                num_steps += 1
    logger.info("the leader shut down after %d steps", num_steps)
    return num_steps
