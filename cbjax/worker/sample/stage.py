"""What a sampler stage is: the per-request columns it reads and what it does to the logits.

A stage (one file each in this folder) declares its columns; SamplingTensors, the runner's
row-by-row path and the persistent batch are all built from those declarations (sampler.py), so a
new sampling feature is a new stage file plus its SamplingParams field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Column:
    """One SamplingTensors field: a value per row, or `width` values per row ([S, width])."""

    name: str
    dtype: type
    pad: float  # the value of padding rows and of rows that do not use the stage: always neutral
    # The row's value from its sampler.SamplingRow; per_step=False: read once per request (its params,
    # seed, penalty slot), True: read at every step the row samples in (its counter, output tokens).
    value: Callable[[Any], Any]
    per_step: bool = False
    width: int | None = None  # None: one value per row
    # Rows whose params do not use the column keep `pad` and their value is never read.
    used_by: Callable[[Any], bool] = lambda params: True

    def padded(self, num_rows: int) -> np.ndarray:
        shape = (num_rows,) if self.width is None else (num_rows, self.width)
        return np.full(shape, self.pad, self.dtype)


@dataclass(frozen=True)
class Stage:
    """A step of the pipeline. A logits stage's `apply(logits, t, penalty_state) -> logits` runs on
    every row (rows that do not use it come out unchanged), under lax.cond only when `in_use(t)`;
    a random stage's `apply(logits, t) -> logits` runs on the random rows' logits. `in_use` works
    on host numpy and device arrays alike (`.any()` of a column test)."""

    name: str
    columns: tuple[Column, ...]
    apply: Callable[..., Any]
    in_use: Callable[[Any], Any]

    @property
    def per_step(self) -> bool:
        """Whether some column changes from step to step (a step using it cannot be followed as is)."""
        return any(column.per_step for column in self.columns)


def left_aligned(values: list, width: int, pad: float, dtype: type) -> np.ndarray:
    """`values` in a row of `width`, the rest `pad`."""
    row = np.full(width, pad, dtype)
    row[: len(values)] = values
    return row
