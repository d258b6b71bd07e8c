"""q/k/v and gate/up fused into one kernel each at load (models/llama.py fuse_projections): what the
fused kernels hold, and that the fused model computes what the checkpoint's does. HF parity of the
fused, packed layout: test_model_parity; the engine packing 4 fused kernels a layer: test_engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers_hf import make_tiny_hf_model
from test_packed_matmul import forward_logits

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.checkpoint.weights_cache import DISABLE_ENV
from cbjax.models.layers.linear import fuse_projections
from kernels_cpu import LAYOUT


def test_each_layers_columns_are_put_side_by_side_in_checkpoint_order():
    """Hand-made kernels [in, out] and biases: the fused kernel's columns are q's, then k's, then v's."""
    rng = np.random.default_rng(0)
    params = {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        for name, width in (("q_proj", 6), ("k_proj", 2), ("v_proj", 2)):
            params[f"{p}self_attn.{name}.kernel"] = rng.standard_normal((4, width)).astype(np.float32)
            params[f"{p}self_attn.{name}.bias"] = rng.standard_normal(width).astype(np.float32)
        for name in ("gate_proj", "up_proj", "down_proj"):
            params[f"{p}mlp.{name}.kernel"] = rng.standard_normal((4, 8) if name != "down_proj" else (8, 4)).astype(np.float32)
    params["model.norm.weight"] = np.ones(4, np.float32)
    original = dict(params)
    fused = fuse_projections(params, num_layers=2)
    for layer in range(2):
        p = f"model.layers.{layer}."
        qkv = fused[f"{p}self_attn.qkv_proj.kernel"]
        assert qkv.shape == (4, 10)
        np.testing.assert_array_equal(qkv[:, :6], original[f"{p}self_attn.q_proj.kernel"])
        np.testing.assert_array_equal(qkv[:, 6:8], original[f"{p}self_attn.k_proj.kernel"])
        np.testing.assert_array_equal(qkv[:, 8:], original[f"{p}self_attn.v_proj.kernel"])
        np.testing.assert_array_equal(fused[f"{p}self_attn.qkv_proj.bias"][8:], original[f"{p}self_attn.v_proj.bias"])
        gate_up = fused[f"{p}mlp.gate_up_proj.kernel"]
        np.testing.assert_array_equal(gate_up[:, 8:], original[f"{p}mlp.up_proj.kernel"])
        assert f"{p}mlp.down_proj.kernel" in fused and f"{p}self_attn.k_proj.kernel" not in fused
    assert sorted(name for name in fused if "layers" not in name) == ["model.norm.weight"]


def test_a_layer_with_only_some_of_its_parts_is_refused_by_name():
    params = {"model.layers.0.mlp.gate_proj.kernel": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.kernel missing beside model\.layers\.0\.mlp\.gate_proj\.kernel"):
        fuse_projections(params, num_layers=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2 (biases on q/k/v), converted."""
    tmp = tmp_path_factory.mktemp("fused")
    hf_dir = make_tiny_hf_model(tmp, "qwen2", name="Tiny-Qwen2")
    return convert_checkpoint(hf_dir, tmp / "ckpt")


CPU_ONLY = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the packed matmul is an XLA:CPU custom call")


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=CPU_ONLY)], ids=["plain", "packed"])
def test_the_fused_model_computes_the_checkpoints_logits(checkpoint, packed):
    split, _ = load_model(checkpoint, pack_for_cpu=packed)
    fused, _ = load_model(checkpoint, pack_for_cpu=packed, fused_projections=True)
    assert not hasattr(split.model.layers[0].self_attn, "qkv_proj") and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
    tokens = [3, 17, 42, 5, 99, 23, 64, 8, 11]
    backend = "cpp" if packed else "xla"
    np.testing.assert_allclose(forward_logits(fused, tokens, backend), forward_logits(split, tokens, backend),
                               rtol=1e-5, atol=1e-5)


def test_the_fused_layout_is_cached_apart_and_mapped_on_the_next_load(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    first, _ = load_model(checkpoint, pack_for_cpu=True, fused_projections=True)
    load_model(checkpoint, pack_for_cpu=True)
    files = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert len(files) == 2 and sum(f".fused+{LAYOUT}-" in name for name in files) == 1, files

    def no_restore(*args, **kwargs):
        raise AssertionError("the second fused load must map the cached fused copy")

    monkeypatch.setattr("cbjax.checkpoint.loader._restore_orbax", no_restore)
    again, _ = load_model(checkpoint, pack_for_cpu=True, fused_projections=True)
    np.testing.assert_array_equal(np.asarray(again.model.layers[1].self_attn.qkv_proj.kernel[...]),
                                  np.asarray(first.model.layers[1].self_attn.qkv_proj.kernel[...]))


def test_tensor_parallel_loads_keep_the_projections_apart(checkpoint):
    with pytest.raises(ValueError, match="under tensor parallelism load with fused_projections=False"):
        load_model(checkpoint, tensor_parallel=object(), fused_projections=True)

