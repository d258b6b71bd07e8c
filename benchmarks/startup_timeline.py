"""When each part of `LLM(model)` starts and ends, on which thread: the kernel build, the weights'
load, each step's trace and lowering, each compile, the warm-up.

    CBJAX_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python -m benchmarks.startup_timeline

With an empty CBJAX_CACHE_DIR this is a cold start (kernel, weights and compilation caches
empty); with a filled one, a warm one. Prints one line per event: seconds since the process
started its imports, the thread, the event. It shows what overlaps what, which phase totals
(cbjax.bench.startup) cannot.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

START = time.perf_counter()
EVENTS: list[tuple[float, str, str]] = []


def mark(event: str) -> None:
    EVENTS.append((time.perf_counter() - START, threading.current_thread().name, event))


def wrap(owner: Any, name: str, label: str) -> None:
    """Mark the start and end of every call of owner.name."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{label} start")
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"{label} end")

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    args = parser.parse_args()
    import cbjax.worker.build as worker_build
    import kernels_cpu.registry as kernel_registry
    from cbjax import LLM
    from cbjax.worker.compilation.compile_cache import StepCache
    from cbjax.worker.model_runner import ModelRunner

    wrap(kernel_registry, "build", "kernel build")
    wrap(worker_build, "load_model", "load weights")
    wrap(ModelRunner, "_lower", "trace and lower")
    wrap(StepCache, "compile_fresh", "compile")
    wrap(ModelRunner, "warm_up", "warm-up")
    mark("imports done")
    LLM(args.model)
    mark("LLM() done")
    for seconds, thread, event in EVENTS:
        print(f"{seconds:7.2f}  {thread[:20]:20s}  {event}")


if __name__ == "__main__":
    main()
