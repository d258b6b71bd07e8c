"""What a long-lived engine process does with its heap after start-up: hand freed memory back to the
OS (so it stops counting in RSS), and take what start-up built out of the garbage collector's scans."""

from __future__ import annotations

import ctypes
import gc
import logging
import time

logger = logging.getLogger(__name__)


def release_free_heap() -> None:
    """Return the free memory of every malloc arena to the OS (glibc keeps it otherwise).

    Restoring a checkpoint leaves its host copies and tensorstore's buffers freed but resident
    (about 150 MB for SmolLM2's 540 MB of weights); compiling the steps cold leaves about 470 MB
    in the compiling threads' arenas. Either would count in the engine's footprint.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to release this way
        pass


def freeze_gc_heap() -> int:
    """Collect once, then move every object alive now out of the cyclic GC's reach (gc.freeze); the count moved.

    A loaded engine holds a few hundred thousand Python objects (the model's structure, jax
    arrays and executables, the tokenizer), and CPython's full collections scan them all: with
    256 requests running, about one step in a hundred paused for a generation-2 collection (the
    retired gc-freeze experiment, docs/benchmarks-history/10-host-per-step.md), a stall of every
    running request. Start-up objects live as long as the process, so a process that serves one
    engine for its lifetime (`cbjax serve`, `cbjax worker`) freezes them once it is ready, as vLLM's
    engine core does. Frozen objects are still freed by reference counting; only cycles among them
    are no longer collected, which is why LLM() and AsyncLLM, which a program may build many of,
    leave this to their caller.
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the garbage collector's scans in %.2f s", frozen, time.perf_counter() - start)
    return frozen
