"""The weights cache: the first load of a checkpoint writes a mapped copy, later loads map it instead of orbax."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import make_tiny_hf_model
from safetensors.numpy import load_file
from test_checkpoint import assert_params_equal_hf

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.checkpoint.params import abstract_model
from cbjax.checkpoint.weights_cache import ALIGNMENT, DISABLE_ENV
from cbjax.models.config import ModelConfig


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf"), "qwen2", name="Tiny-Qwen2")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder with the weights cache on (conftest turns it off for the other tests)."""
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return tmp_path / "cache" / "weights"


def no_orbax(*args, **kwargs):
    raise AssertionError("a load from the weights cache must not restore the orbax checkpoint")


def test_second_load_maps_the_cached_copy_instead_of_restoring(hf_dir, tmp_path, cache, monkeypatch):
    checkpoint = convert_checkpoint(hf_dir, tmp_path / "ckpt")
    first, _ = load_model(checkpoint)
    assert_params_equal_hf(first, hf_dir)
    [copy] = cache.iterdir()
    monkeypatch.setattr("cbjax.checkpoint.loader._restore_orbax", no_orbax)
    second, _ = load_model(checkpoint)
    assert_params_equal_hf(second, hf_dir)
    # The copy is a standard safetensors file (read here by the safetensors library) with the same tensors.
    stored = load_file(copy)
    for path, variable in nnx.to_flat_state(nnx.state(second, nnx.Param)):
        np.testing.assert_array_equal(stored[".".join(map(str, path))], np.asarray(variable.get_value()))


def test_weight_matrices_start_aligned_so_the_device_takes_them_without_a_copy(hf_dir, tmp_path, cache):
    load_model(convert_checkpoint(hf_dir, tmp_path / "ckpt"))
    [copy] = cache.iterdir()
    raw = copy.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    assert (8 + header_len) % ALIGNMENT == 0
    matrices = [entry for entry in header.values() if len(entry["shape"]) == 2]
    assert matrices and all(entry["data_offsets"][0] % ALIGNMENT == 0 for entry in matrices)


def test_a_reconverted_checkpoint_or_another_dtype_gets_a_fresh_copy(hf_dir, tmp_path, cache, monkeypatch):
    checkpoint = convert_checkpoint(hf_dir, tmp_path / "ckpt")
    load_model(checkpoint)
    [stale] = cache.iterdir()
    half, _ = load_model(checkpoint, dtype="bfloat16")
    assert_params_equal_hf(half, hf_dir, dtype=jnp.bfloat16)
    assert len(list(cache.iterdir())) == 2  # one per dtype
    # Converting again (new files, as after `cbjax convert` of a fine-tune) replaces the float32 copy.
    for file in (checkpoint / "params").rglob("*"):
        file.touch() if file.is_file() else None
    model, _ = load_model(checkpoint, dtype="float32")
    assert_params_equal_hf(model, hf_dir)
    assert not stale.exists() and len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_warns_and_loads_from_the_checkpoint(hf_dir, tmp_path, cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the folder should be")
    with pytest.warns(UserWarning, match="could not write the weights cache"):
        model, _ = load_model(convert_checkpoint(hf_dir, tmp_path / "ckpt"))
    assert_params_equal_hf(model, hf_dir)


def test_the_env_flag_turns_the_cache_off(hf_dir, tmp_path, cache, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(convert_checkpoint(hf_dir, tmp_path / "ckpt"))
    assert not cache.exists()


def test_the_abstract_model_has_the_shapes_nnx_rngs_give(hf_dir):
    """abstract_model stands a fixed key in for nnx.Rngs (much faster under eval_shape): same structure."""
    config = ModelConfig.from_dir(hf_dir)
    fast = abstract_model(config, jnp.float32, jnp.float32)
    from cbjax.models.llama import LlamaForCausalLM

    slow = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.float32, activation_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    (fast_def, fast_state), (slow_def, slow_state) = nnx.split(fast), nnx.split(slow)
    assert fast_def == slow_def
    shapes = lambda state: {path: (type(v), jax.typeof(v.get_value())) for path, v in nnx.to_flat_state(state)}  # noqa: E731
    assert shapes(fast_state) == shapes(slow_state)
