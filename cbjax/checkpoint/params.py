"""The model's parameter set by name, how Hugging Face tensors map onto it, and the check between them.

Parameters are named by their dotted nnx path (`model.layers.0.self_attn.q_proj.kernel`); the
orbax checkpoint stores them as the nested dict of those names.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.models.config import ModelConfig
from cbjax.models.layers.linear import declare_quantized
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
                   fused_projections: bool = False, quantization: str | None = None) -> nnx.Module:
    """The model (its registry entry's class) with shapes and dtypes only: no memory, no random init.
    `quantization`: its projections int8 with scales (declare_quantized)."""
    return nnx.merge(*abstract_split(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype),
                                     fused_projections, quantization))


@functools.lru_cache(maxsize=8)  # a load needs it twice: the parameters to expect, then the model to fill
def abstract_split(
    config: ModelConfig, dtype: jnp.dtype, activation_dtype: jnp.dtype | None = None, fused_projections: bool = False,
    quantization: str | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """nnx.split of the abstract model (read-only: callers replace its variables, never set them)."""
    return nnx.split(nnx.eval_shape(
        lambda: declare_quantized(model_class(config)(config, dtype=dtype, activation_dtype=activation_dtype,
                                                      rngs=_FixedKey(), fused_projections=fused_projections), quantization)
    ))


def param_name(path: tuple) -> str:
    return ".".join(str(key) for key in path)


def named_arrays(state: nnx.State) -> dict[str, Any]:
    """Every variable's value in `state` by dotted name (param_name): arrays, or shape structs of an abstract state."""
    return {param_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def expected_params(
    config: ModelConfig, dtype: jnp.dtype, activation_dtype: jnp.dtype | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter the model has, by name, with the shape and dtype it must be loaded with
    (activation_dtype changes none of them; pass the one the model is built with to share its build):
    a checkpoint's parameters, so projections unfused."""
    _, state = abstract_split(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype))
    return named_arrays(nnx.filter_state(state, nnx.Param))


def hf_to_params(hf_name: str, tensor: np.ndarray, config: ModelConfig) -> list[tuple[str, np.ndarray, int | None]]:
    """Map one HF tensor to [(our name, our layout, its expert's index in a stacked kernel or None)]; empty
    for tensors the model does not load. The name is the registry entry's; a linear's kernel is transposed
    (nn.Linear [out, in] -> nnx [in, out]), and all experts' fused gate_up_proj [E, 2 x inner, hidden]
    (transformers 5's in-memory layout) becomes the stacked gate_proj and up_proj [E, hidden, inner]."""
    slot = architecture(config.architecture).param_slot(hf_name, tensor.ndim, config.tie_word_embeddings)
    if slot is None:
        return []
    name, expert = slot
    if not name.endswith(".kernel"):
        return [(name, tensor, expert)]
    kernel = np.ascontiguousarray(np.swapaxes(tensor, -1, -2))
    if name.endswith(".experts.gate_up_proj.kernel"):
        experts = name.removesuffix(".gate_up_proj.kernel")
        gate, up = np.split(kernel, 2, axis=-1)
        return [(f"{experts}.gate_proj.kernel", np.ascontiguousarray(gate), None),
                (f"{experts}.up_proj.kernel", np.ascontiguousarray(up), None)]
    return [(name, kernel, expert)]


def cast_param(name: str, tensor: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
    """`tensor` in `dtype`; an fp8 kernel kept as stored and its float32 scales as they are (fp8_checkpoint.py)."""
    if tensor.dtype == jnp.float8_e4m3fn or name.endswith(".scales"):
        return tensor
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
) -> Iterator[tuple[str, np.ndarray, int | None]]:
    """Stream HF tensors to (name, array, expert index or None) in our layout and dtype, one at a time."""
    for hf_name, tensor in hf_tensors:
        for name, array, expert in hf_to_params(hf_name, tensor, config):
            yield name, cast_param(name, array, dtype), expert


def stack_experts(
    pieces: Iterable[tuple[str, np.ndarray, int | None]], num_experts: int, source: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every parameter: each expert's projection (index not None) written into its
    stacked kernel [num_experts, in, out], yielded once every expert is in; the rest as they come.
    Memory stays one model copy: a stacked kernel is allocated once and filled in place."""
    stacks: dict[str, tuple[np.ndarray, set[int]]] = {}
    for name, array, expert in pieces:
        if expert is None:
            yield name, array
            continue
        if not 0 <= expert < num_experts:
            raise ValueError(f"{source}: tensor {name} of expert {expert}; the config has num_experts={num_experts}")
        stacked, filled = stacks.setdefault(name, (np.empty((num_experts, *array.shape), array.dtype), set()))
        if stacked.shape[1:] != array.shape or expert in filled:
            raise ValueError(f"{source}: expert {expert}'s {name} has shape {array.shape}, or appears twice; "
                             f"the other experts' are {stacked.shape[1:]}")
        stacked[expert] = array
        filled.add(expert)
        if len(filled) == num_experts:
            yield name, stacks.pop(name)[0]
    for name, (_, filled) in stacks.items():
        missing = sorted(set(range(num_experts)) - filled)
        raise ValueError(f"{source}: tensor {name} lacks experts {missing} of num_experts={num_experts}")


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
