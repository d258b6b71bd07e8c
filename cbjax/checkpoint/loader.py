"""Build the model abstractly and fill it from a converted checkpoint (or straight from an HF directory)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.checkpoint.convert import PARAMS_DIR, read_hf_params, resolve_dtype
from cbjax.checkpoint.fp8_checkpoint import check_not_requantized
from cbjax.checkpoint.gguf_import import GGUF_FILE
from cbjax.checkpoint.gguf_params import check_as_stored, read_gguf_params
from cbjax.checkpoint.params import abstract_model, check_params, expected_params, flatten_params, nest_params, param_name
from cbjax.checkpoint.weights_cache import cached_weights
from cbjax.models.config import ModelConfig
from cbjax.heap import release_free_heap
from cbjax.models.tensor_parallel import check_whole_groups
from cbjax.quantization import check_quantized_lm_head
from cbjax.models.layers.linear import PACKED_DTYPES, declare_stored, fuse_projections, pack_linears, quantize_linears
from kernels_cpu import LAYOUT as PACKED_LAYOUT

logger = logging.getLogger(__name__)


class ShardedPlacement(Protocol):
    """What a load under tensor parallelism asks of the mesh (cbjax.worker.distributed.sharding.TensorParallel)."""

    size: int  # devices

    def restore_sharding(self, name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding: ...

    def weight_sharding(self, name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding: ...

    def repeat_kv_heads(self, params: dict[str, np.ndarray | jax.Array], config: ModelConfig) -> dict[str, np.ndarray | jax.Array]: ...

    def serving_config(self, config: ModelConfig) -> ModelConfig: ...


def load_model(
    ckpt_dir: str | Path, dtype: str | None = None, activation_dtype: str | None = None,
    tensor_parallel: ShardedPlacement | None = None, pack_for_cpu: bool = False, fused_projections: bool = False,
    quantization: str | None = None, quantize_lm_head: bool = False, pack_floats: bool = True,
) -> tuple[nnx.Module, ModelConfig]:
    """Load a converted checkpoint (params/ + config.json), an HF safetensors directory directly, or a
    GGUF file's directory (resolve.py: its quantized tensors as stored, see gguf_params.py), into the
    class of its architecture's registry entry.

    dtype=None keeps the stored dtype and requires every tensor to have it; a dtype casts on load.
    activation_dtype: see models.llama.LlamaForCausalLM (None: the same as the weights).
    Every tensor's name, shape and dtype is checked against the model before anything is restored.
    tensor_parallel: orbax restores each tensor straight into its sharding (an HF directory is read
    on the host, then each tensor is put into its sharding), so no device ever holds the whole
    model; KV heads are repeated as it says, and the config returned is the served one.
    fused_projections: the model built with fused_projections=True, its fused kernels made
    from the checkpoint's (not under tensor parallelism, whose column split keeps them apart).
    quantization: "int8" or "int4..." quantizes every decoder projection here, at load, after fusing (see
    quantize_linears; with pack_for_cpu, into int8 or nibble panels for the C++ matmul). The checkpoint and
    the weights cache stay float. Under tensor parallelism, projections quantized in groups (and a GGUF
    file's quantized ones) must split into whole groups per device (check_whole_groups).
    quantize_lm_head: the LM head (a tied model's embedding) quantized too (quantize_linears' `lm_head`;
    one device only).
    pack_floats: with pack_for_cpu, float projections (and a tied 16-bit head) packed too; False packs only
    quantized kernels (the engine's choice for bfloat16 without AMX: worker/build.py).
    """
    ckpt_dir = Path(ckpt_dir)
    config = ModelConfig.from_dir(ckpt_dir)
    check_not_requantized(json.loads((ckpt_dir / "config.json").read_text()), quantization, str(ckpt_dir))
    model_dtype = resolve_dtype(dtype, config)
    if quantize_lm_head:
        check_quantized_lm_head(True, quantization, 1 if tensor_parallel is None else tensor_parallel.size)
    if fused_projections and tensor_parallel is not None:
        raise ValueError("fused_projections is for one device; under tensor parallelism load with fused_projections=False")
    # Built with the model's activation dtype, so the model filled below reuses this abstract build.
    expected = expected_params(config, jnp.dtype(model_dtype), activation_dtype)
    # Quantized projections are packed after quantizing (int8 panels), not as floats here.
    # Without float packing only a GGUF file holds kernels to pack (as stored): no packing step otherwise, so an
    # orbax checkpoint maps the same cached layout as an unpacked load instead of writing a copy of its own.
    gguf = (ckpt_dir / GGUF_FILE).exists()
    arrange = _arrangement(config, model_dtype, fused_projections,
                           pack_for_cpu and quantization is None and (pack_floats or gguf), pack_floats)
    if gguf:
        check_as_stored(ckpt_dir, quantization)
        params = read_gguf_params(ckpt_dir / GGUF_FILE, config, model_dtype, tensor_parallel=tensor_parallel is not None)
        if arrange is not None:
            params = arrange[1](params)
    elif (ckpt_dir / PARAMS_DIR).is_dir() and tensor_parallel is None:
        params = cached_weights(  # a memory-mapped copy after the first load (see weights_cache.py)
            ckpt_dir / PARAMS_DIR, model_dtype, expected,
            lambda: _restore_orbax(ckpt_dir / PARAMS_DIR, expected, cast=dtype is not None),
            layout=arrange,
        )
    elif (ckpt_dir / PARAMS_DIR).is_dir():
        params = _restore_orbax(ckpt_dir / PARAMS_DIR, expected, cast=dtype is not None,
                                sharding=tensor_parallel.restore_sharding)
    else:
        params = read_hf_params(ckpt_dir, config, model_dtype, progress=False, keep_fp8=True)
        if arrange is not None:
            params = arrange[1](params)
    if tensor_parallel is None:
        params = _quantize(params, quantization, pack=pack_for_cpu, lm_head=quantize_lm_head)
        model = _fill_model(config, model_dtype, params, activation_dtype, fused_projections=fused_projections,
                            quantization=quantization)
        if pack_for_cpu and pack_floats and jnp.dtype(model_dtype) in PACKED_DTYPES:
            model.pack_tied_head()
    else:
        params = _quantize(tensor_parallel.repeat_kv_heads(params, config), quantization)
        check_whole_groups(params, config, tensor_parallel.size)  # before any weight is placed
        config = tensor_parallel.serving_config(config)
        place = lambda name, array: jax.device_put(array, tensor_parallel.weight_sharding(name, array.shape))  # noqa: E731
        model = _fill_model(config, model_dtype, params, activation_dtype, place, quantization=quantization)
    release_free_heap()
    return model, config


def _arrangement(
    config: ModelConfig, dtype: str, fused: bool, packed: bool, pack_floats: bool = True,
) -> tuple[str, Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]] | None:
    """How a checkpoint's weights are rearranged for the model (fused projections, then packed for
    the CPU kernel: float projections too unless not pack_floats), and that layout's name in the weights
    cache; None: kept as stored."""
    steps = [("fused", functools.partial(fuse_projections, num_layers=config.num_hidden_layers))] if fused else []
    if packed:
        steps.append((PACKED_LAYOUT if pack_floats else f"{PACKED_LAYOUT}-quantized-only",
                      functools.partial(pack_linears, dtype=dtype, floats=pack_floats)))
    if not steps:
        return None

    def arrange(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for _, step in steps:
            params = step(params)
        return params

    return "+".join(name for name, _ in steps), arrange


def _quantize(
    params: dict[str, np.ndarray | jax.Array], quantization: str | None, pack: bool = False, lm_head: bool = False,
) -> dict[str, np.ndarray | jax.Array]:
    """quantize_linears, and the start-up log line that says what it did."""
    if quantization is None:
        return params
    before = sum(array.nbytes for array in params.values())
    params = quantize_linears(params, quantization, pack, lm_head)
    num_projections = sum(name.endswith(".scales") for name in params)
    after = sum(array.nbytes for array in params.values())
    logger.info("quantization: %s (%d projections%s%s, %.2f GiB -> %.2f GiB)", quantization, num_projections,
                ", the LM head among them" if lm_head else "", ", packed for the C++ matmul" if pack else "", before / 2**30, after / 2**30)
    return params


def _restore_orbax(
    params_dir: Path, expected: dict[str, jax.ShapeDtypeStruct], *, cast: bool,
    sharding: Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | None = None,
) -> dict[str, np.ndarray | jax.Array]:
    """Every stored tensor by name (checked against `expected`, cast to its dtypes if `cast`): numpy
    on the host, or with `sharding` jax arrays restored into it."""
    import orbax.checkpoint as ocp  # 0.5 s of imports that a load from the weights cache skips

    with ocp.StandardCheckpointer() as checkpointer:
        stored = flatten_params(checkpointer.metadata(params_dir.resolve()).item_metadata.tree)
        found = {
            name: (tuple(meta.shape), expected[name].dtype if cast and name in expected else meta.dtype)
            for name, meta in stored.items()
        }
        check_params(expected, found, source=str(params_dir))
        if sharding is None:
            return flatten_params(checkpointer.restore(params_dir.resolve()))
        target = nest_params({
            name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(name, shape)) for name, (shape, dtype) in found.items()
        })
        return flatten_params(checkpointer.restore(params_dir.resolve(), target))


def _fill_model(
    config: ModelConfig, dtype: str, params: dict[str, np.ndarray | jax.Array], activation_dtype: str | None = None,
    place: Callable[[str, np.ndarray | jax.Array], jax.Array] = lambda name, array: jax.device_put(array, may_alias=True),
    fused_projections: bool = False, quantization: str | None = None,
) -> nnx.Module:
    """Place checked params into the abstract model, casting one tensor at a time; each host array is
    released once it is on device, so at most one extra tensor is alive beyond one model copy.
    `place` puts one named tensor on its device(s) (a no-op for one already restored there); by
    default XLA:CPU takes an aligned host array of the right dtype as it is, without a copy.
    Each tensor is cast to its variable's dtype: `dtype`, or int8 kernels and float32 scales where quantized
    (quantized kernels kept as stored where `params` holds them so: declare_stored)."""
    graphdef, abstract_state = nnx.split(declare_stored(
        abstract_model(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype),
                       fused_projections, quantization), params
    ))
    filled = [
        (path, variable.replace(
            place(param_name(path), params.pop(param_name(path)).astype(variable.dtype, copy=False))
            if isinstance(variable, nnx.Param)
            else jnp.zeros(variable.shape, variable.dtype)  # derived below, from the parameters
        ))
        for path, variable in nnx.to_flat_state(abstract_state)
    ]
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    model.derive_weights()
    return model
