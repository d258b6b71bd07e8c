"""How the weights travel into a step: the vectors stacked, so a call passes fewer arrays.

A compiled step's call costs the host about half a microsecond per argument array on this
project's CPUs (PjRt's per-buffer work, not Python: benchmarks/step_dispatch.py); a GPU client
does per-buffer work on its host too (not yet measured there). SmolLM2's 186 weight arrays (its
projections fused) include 61 norm vectors of 576 values; sent as one [61, 576] array, the call
passes 126. Inside the step each is a row read by a static index, which XLA fuses into the
elementwise op that uses it (the norm's scale, a bias add): nothing is copied, and every value is
the same.

Only vectors (norm scales, biases) are stacked: a row of a stack of matrices that feeds a dot is
a copy on XLA:CPU (a chain of dots over stacked matrices ran slower than over separate arrays: the retired
stacked-matrices experiment, docs/benchmarks-history/10-host-per-step.md, "The weights' vectors stacked").
And only vectors whole on every device they live on (replicated), with the same shape, dtype and
devices, so the stack has one sharding, the same as each of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class WeightStacks:
    """Which of the model's flat weights travel stacked: entry j of a step's weights is the
    model's weight `entries[j]` (an int) or the stack of the weights it lists (a tuple, in row order)."""

    num_weights: int
    entries: tuple[int | tuple[int, ...], ...]

    @classmethod
    def of(cls, weights: Sequence[jax.Array]) -> WeightStacks:
        """Stack every group of two or more replicated vectors alike in shape, dtype and devices;
        each stack takes the place of its first member, the other weights keep their order."""
        groups: dict[tuple, list[int]] = {}
        for index, weight in enumerate(weights):
            # (an abstract runner's weights are ShapeDtypeStructs, whose sharding may be unset: one device)
            if weight.ndim == 1 and (weight.sharding is None or weight.sharding.is_fully_replicated):
                groups.setdefault((weight.shape, weight.dtype, weight.sharding), []).append(index)
        stacked = {members[0]: tuple(members) for members in groups.values() if len(members) > 1}
        inside = {index for members in stacked.values() for index in members}
        entries = tuple(stacked.get(index, index) for index in range(len(weights))
                        if index in stacked or index not in inside)
        return cls(len(weights), entries)

    def stack(self, weights: Sequence[jax.Array]) -> list[jax.Array]:
        """The arrays a step takes (made once, at start-up): each stack on its members' devices
        (or, for jax.ShapeDtypeStructs, its shape and sharding)."""
        if len(weights) != self.num_weights:
            raise ValueError(f"{len(weights)} weights given; these stacks were planned for {self.num_weights}")
        return [weights[entry] if isinstance(entry, int) else _stack([weights[i] for i in entry])
                for entry in self.entries]

    def unstack(self, step_weights: Sequence[jax.Array]) -> list[jax.Array]:
        """The model's flat weights again, in their order (traced inside the step: a stack's rows by static index)."""
        weights: list[jax.Array | None] = [None] * self.num_weights
        for entry, array in zip(self.entries, step_weights, strict=True):
            if isinstance(entry, int):
                weights[entry] = array
            else:
                for row, index in enumerate(entry):
                    weights[index] = array[row]
        return weights


def _stack(members: list[jax.Array]) -> jax.Array:
    if isinstance(members[0], jax.ShapeDtypeStruct):  # an abstract runner's (abstract_lowering.py)
        return jax.ShapeDtypeStruct((len(members), *members[0].shape), members[0].dtype, sharding=members[0].sharding)
    # Jitted with the members' own sharding: under tensor parallelism (one or several processes)
    # the stack is replicated over the same devices as each of them.
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=members[0].sharding)(*members)
