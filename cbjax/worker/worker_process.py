"""`cbjax worker`: a multi-host process > 0, which builds its shards of the engine and runs the leader's steps.

Above both worker/build.py (which builds the device side and attaches the step broadcast) and
distributed/multihost.py (the broadcast and the step loop), so neither imports the other's caller.
"""

from __future__ import annotations

import sys

from cbjax.config import EngineConfig
from cbjax.heap import freeze_gc_heap
from cbjax.worker.build import build_worker
from cbjax.worker.distributed.multihost import PeerLostError, serve_steps


def run_worker(model: str, options: dict) -> None:
    """`cbjax worker`: build the same engine as process 0 (its own shards), then run its steps."""
    config = EngineConfig(model=model, **options)
    if config.num_processes < 2 or config.process_id == 0:
        raise ValueError(
            f"cbjax worker needs --num-processes >= 2 and --process-id >= 1, got {config.num_processes} and "
            f"{config.process_id}; process 0 serves (cbjax serve / generate, or LLM(...) with the same options)"
        )
    worker = build_worker(config, progress=False)
    freeze_gc_heap()  # a GC pause here would stall every process's collectives
    try:
        serve_steps(worker.runner, worker.step_broadcast)
    except PeerLostError as error:
        sys.exit(f"cbjax worker: {error}")  # the exit status is PEER_LOST_EXIT_STATUS (peer_failures)
