"""One transfer per direction: pack a pytree of 32-bit arrays into a flat int32 buffer.

The host packs with numpy (no device arrays, so no compiles); the jitted step
unpacks with static offsets. float32 fields travel as their bit patterns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Static description of a packed pytree: its structure and each leaf's shape and dtype."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @functools.cached_property
    def host_views(self) -> list[tuple[int, int, np.dtype, tuple[int, ...]]]:
        """Each leaf's start and end in the buffer, dtype and shape: what unpack_host slices (every step)."""
        views, offset = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            size = math.prod(shape)
            views.append((offset, offset + size, np.dtype(dtype), shape))
            offset += size
        return views

    def leaf_slice(self, leaf: Any) -> slice:
        """Where the leaf picked by `leaf` (a function of the tree, e.g. `lambda t: t.sampling.temperature`) lies in the buffer."""
        index = leaf(jax.tree_util.tree_unflatten(self.treedef, range(len(self.shapes))))
        start, end, _, _ = self.host_views[index]
        return slice(start, end)

    @classmethod
    def of(cls, tree: Any) -> "PackedLayout":
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        for leaf in leaves:
            if np.dtype(leaf.dtype).itemsize != 4:
                raise TypeError(f"packed leaves must be 32-bit, got {leaf.dtype}")
        return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves), tuple(np.dtype(x.dtype).name for x in leaves))


def pack(tree: Any) -> np.ndarray:
    """Flatten a pytree of 32-bit numpy arrays into one int32 vector (read-only).

    Each leaf's bytes joined: fewer numpy calls per leaf than viewing each as int32 and
    concatenating (about 25 leaves, every step)."""
    return np.frombuffer(b"".join([leaf.tobytes() for leaf in jax.tree_util.tree_leaves(tree)]), np.int32)


def unpack(flat: jax.Array, layout: PackedLayout) -> Any:
    """Inverse of `pack`, traced inside the step with static offsets."""
    leaves, offset = [], 0
    for shape, dtype in zip(layout.shapes, layout.dtypes):
        size = math.prod(shape)
        chunk = jax.lax.slice_in_dim(flat, offset, offset + size).reshape(shape)
        if dtype != "int32":
            chunk = jax.lax.bitcast_convert_type(chunk, jnp.dtype(dtype))
        leaves.append(chunk)
        offset += size
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def pack_device(tree: Any) -> jax.Array:
    """Device-side `pack`: one int32 vector, so results come back in one transfer."""
    leaves = jax.tree_util.tree_leaves(tree)
    parts = [
        (leaf if leaf.dtype == jnp.int32 else jax.lax.bitcast_convert_type(leaf, jnp.int32)).ravel()
        for leaf in leaves
    ]
    return jnp.concatenate(parts)


def unpack_host(flat: np.ndarray, layout: PackedLayout) -> Any:
    """Host-side `unpack` of a buffer returned by the step (numpy views, no copies)."""
    leaves = [flat[start:end].view(dtype).reshape(shape) for start, end, dtype, shape in layout.host_views]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)
