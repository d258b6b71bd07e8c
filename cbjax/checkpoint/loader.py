"""Build the model abstractly and fill it from a converted checkpoint (or straight from an HF directory)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from cbjax.checkpoint.convert import PARAMS_DIR, read_hf_params, resolve_dtype
from cbjax.checkpoint.params import abstract_model, check_params, expected_params, flatten_params, param_name
from cbjax.config import ModelConfig
from cbjax.models.llama import LlamaForCausalLM


def load_model(
    ckpt_dir: str | Path, dtype: str | None = None, activation_dtype: str | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a converted checkpoint (params/ + config.json), or an HF safetensors directory directly.

    dtype=None keeps the stored dtype and requires every tensor to have it; a dtype casts on load.
    activation_dtype: see LlamaForCausalLM (None: the same as the weights).
    Every tensor's name, shape and dtype is checked against the model before anything is restored.
    """
    ckpt_dir = Path(ckpt_dir)
    config = ModelConfig.from_dir(ckpt_dir)
    model_dtype = resolve_dtype(dtype, config)
    if (ckpt_dir / PARAMS_DIR).is_dir():
        params = _restore_orbax(ckpt_dir / PARAMS_DIR, config, model_dtype, cast=dtype is not None)
    else:
        params = read_hf_params(ckpt_dir, config, model_dtype, progress=False)
    model = _fill_model(config, model_dtype, params, activation_dtype)
    release_free_heap()
    return model, config


def release_free_heap() -> None:
    """Hand the heap that loading freed back to the OS (glibc keeps it otherwise).

    Restoring a checkpoint leaves the host copies and tensorstore's buffers freed but resident:
    about 150 MB for SmolLM2's 540 MB of weights, which would count in the engine's footprint.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to release this way
        pass


def _restore_orbax(params_dir: Path, config: ModelConfig, dtype: str, *, cast: bool) -> dict[str, np.ndarray]:
    expected = expected_params(config, jnp.dtype(dtype))
    with ocp.StandardCheckpointer() as checkpointer:
        stored = flatten_params(checkpointer.metadata(params_dir.resolve()).item_metadata.tree)
        found = {
            name: (tuple(meta.shape), expected[name].dtype if cast and name in expected else meta.dtype)
            for name, meta in stored.items()
        }
        check_params(expected, found, source=str(params_dir))
        return flatten_params(checkpointer.restore(params_dir.resolve()))


def _fill_model(
    config: ModelConfig, dtype: str, params: dict[str, np.ndarray], activation_dtype: str | None = None
) -> LlamaForCausalLM:
    """Place checked params into the abstract model, casting one tensor at a time; each host array is
    released once it is on device, so at most one extra tensor is alive beyond one model copy."""
    graphdef, abstract_state = nnx.split(
        abstract_model(config, jnp.dtype(dtype), None if activation_dtype is None else jnp.dtype(activation_dtype))
    )
    filled = [
        (path, variable.replace(
            jnp.asarray(params.pop(param_name(path)), dtype=dtype) if isinstance(variable, nnx.Param)
            else jnp.zeros(variable.shape, variable.dtype)  # derived below, from the parameters
        ))
        for path, variable in nnx.to_flat_state(abstract_state)
    ]
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    model.derive_weights()
    return model
