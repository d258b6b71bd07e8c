"""The model's parameter set by name, how Hugging Face tensors map onto it, and the check between them.

Parameters are named by their dotted nnx path (`model.layers.0.self_attn.q_proj.kernel`); the
orbax checkpoint stores them as the nested dict of those names.
"""

from __future__ import annotations

import functools
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.models.config import ModelConfig
from cbjax.models.registry import architecture, model_class


class _FixedKey:
    """Stands in for nnx.Rngs where only shapes are wanted: every stream gives the same key.

    Under eval_shape each call of an nnx.Rngs stream sets a traced counter, and flax then asks the
    tracer for its sharding, whose error message JAX builds by walking the whole trace so far:
    quadratic in the number of layers: seconds of SmolLM2's load, most of the abstract model's build.
    """

    def __getattr__(self, stream: str):
        return lambda: jax.random.key(0)


def abstract_model(config: ModelConfig, dtype: jnp.dtype, activation_dtype: jnp.dtype | None = None,
                   fused_projections: bool = False) -> nnx.Module:
    """The model (its registry entry's class) with shapes and dtypes only: no memory, no random init."""
    return nnx.merge(*abstract_split(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype),
                                     fused_projections))


@functools.lru_cache(maxsize=8)  # a load needs it twice: the parameters to expect, then the model to fill
def abstract_split(
    config: ModelConfig, dtype: jnp.dtype, activation_dtype: jnp.dtype | None = None, fused_projections: bool = False,
) -> tuple[nnx.GraphDef, nnx.State]:
    """nnx.split of the abstract model (read-only: callers replace its variables, never set them)."""
    return nnx.split(nnx.eval_shape(
        lambda: model_class(config)(config, dtype=dtype, activation_dtype=activation_dtype, rngs=_FixedKey(),
                                    fused_projections=fused_projections)
    ))


def param_name(path: tuple) -> str:
    return ".".join(str(key) for key in path)


def expected_params(
    config: ModelConfig, dtype: jnp.dtype, activation_dtype: jnp.dtype | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter the model has, by name, with the shape and dtype it must be loaded with
    (activation_dtype changes none of them; pass the one the model is built with to share its build):
    a checkpoint's parameters, so projections unfused."""
    _, state = abstract_split(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype))
    return {param_name(path): var.get_value() for path, var in nnx.to_flat_state(nnx.filter_state(state, nnx.Param))}


def hf_to_param(hf_name: str, tensor: np.ndarray, config: ModelConfig) -> tuple[str, np.ndarray] | None:
    """Map one HF tensor to (our name, our layout); None for tensors the model does not load.
    The name is the registry entry's; a linear's kernel is transposed (nn.Linear [out, in] -> nnx [in, out])."""
    name = architecture(config.architecture).param_name(hf_name, tensor.ndim, config.tie_word_embeddings)
    if name is None:
        return None
    if name.endswith(".kernel"):
        return name, np.ascontiguousarray(tensor.T)
    return name, tensor


def cast_param(name: str, tensor: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
    if not jnp.issubdtype(tensor.dtype, jnp.floating):
        raise ValueError(f"tensor {name} has dtype {tensor.dtype}; only floating-point weights are supported")
    return tensor.astype(np.dtype(dtype), copy=False)


def check_params(
    expected: dict[str, jax.ShapeDtypeStruct],
    found: dict[str, tuple[tuple[int, ...], np.dtype]],
    source: str,
) -> None:
    """Raise a ValueError naming every missing, extra, mis-shaped or mis-typed tensor."""
    problems = [f"missing tensor {name} {tuple(spec.shape)}" for name, spec in expected.items() if name not in found]
    problems += [f"unexpected tensor {name} {shape}" for name, (shape, _) in found.items() if name not in expected]
    for name, (shape, dtype) in found.items():
        spec = expected.get(name)
        if spec is None:
            continue
        if tuple(shape) != tuple(spec.shape):
            problems.append(f"tensor {name} has shape {tuple(shape)}; the model expects {tuple(spec.shape)}")
        elif np.dtype(dtype) != np.dtype(spec.dtype):
            problems.append(
                f"tensor {name} has dtype {np.dtype(dtype)}; the model expects {np.dtype(spec.dtype)} "
                f"(pass dtype= to cast on load)"
            )
    if problems:
        raise ValueError(f"{source} does not match the model config:\n  " + "\n  ".join(problems))


def convert_hf_tensors(
    hf_tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig, dtype: jnp.dtype
) -> Iterator[tuple[str, np.ndarray]]:
    """Stream HF tensors to (name, array) in our layout and dtype, one at a time."""
    for hf_name, tensor in hf_tensors:
        mapped = hf_to_param(hf_name, tensor, config)
        if mapped is not None:
            name, array = mapped
            yield name, cast_param(name, array, dtype)


def nest_params(flat: dict[str, object]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}: the tree orbax stores."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def flatten_params(tree: dict, prefix: str = "") -> dict[str, object]:
    """The inverse of nest_params."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, name + "."))
        else:
            flat[name] = value
    return flat
