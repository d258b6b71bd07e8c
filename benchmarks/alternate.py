"""Engines timed on the same `LLM.generate` calls, alternating which goes first each round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

Workload = Callable[[], tuple[list[Any], Any]]  # -> (prompts, SamplingParams), made afresh each round


def alternate_generate(
    engines: dict[Hashable, Any], workloads: dict[str, Workload], rounds: int, order: tuple[Hashable, ...]
) -> dict[tuple[str, Hashable], list[float]]:
    """Wall seconds of each (workload, engine) per round; engines run in `order` in even rounds and
    reversed in odd ones, each workload's prompts made once per round and given to every engine."""
    runs: dict[tuple[str, Hashable], list[float]] = {}
    for round_index in range(rounds):
        for name, make in workloads.items():
            prompts, params = make()
            for label in order if round_index % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                engines[label].generate(prompts, params, use_tqdm=False)
                runs.setdefault((name, label), []).append(time.perf_counter() - start)
    return runs


def medians(runs: dict[tuple[str, Hashable], list[float]], name: str, base: Hashable, new: Hashable) -> tuple[float, float]:
    """(base's, new's) median seconds on workload `name`."""
    return statistics.median(runs[name, base]), statistics.median(runs[name, new])
