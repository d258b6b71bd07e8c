"""quantize_lm_head (loader.load_model, linear.quantize_linears): the LM head, or a tied model's embedding kept
as that head's kernel, quantized with `quantization`'s scheme. Against the same model with a float head: each
int8 logit is off by at most half its vocabulary row's scale times sum |x| (x the normed hidden state), and
greedy picks agree where the float margin is wider than that."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_gguf_import import write_tiny_llama_gguf

from cbjax.checkpoint.convert import convert_checkpoint
from cbjax.checkpoint.gguf_import import import_gguf
from cbjax.checkpoint.loader import load_model
from cbjax.config import EngineConfig
from cbjax.models.layers.linear import declare_quantized
from cbjax.models.registry import model_class


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_int8_lm_head_is_within_half_a_scale_of_the_float_head(tmp_path, tied, packed):
    write_tiny_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    checkpoint = convert_checkpoint(import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf"), tmp_path / "float")
    float_head, _ = load_model(checkpoint, quantization="int8", pack_for_cpu=packed, fused_projections=True)
    int8_head, _ = load_model(checkpoint, quantization="int8", pack_for_cpu=packed, fused_projections=True,
                              quantize_lm_head=True)
    head = int8_head.model.embed_tokens if tied else int8_head.lm_head
    assert (head.embedding if tied else head.kernel)[...].dtype == jnp.int8
    tokens = jnp.asarray(np.random.default_rng().integers(3, 250, 12))
    rows = float_head.embed(tokens)  # any rows of the head's input width, the same into both heads
    hidden = float_head.model.norm(rows)
    want = np.asarray(float_head.compute_logits(rows), np.float64)
    got = np.asarray(int8_head.compute_logits(rows), np.float64)
    scales = np.asarray(head.scales[...], np.float64)
    bound = np.abs(np.asarray(hidden, np.float64)).sum(axis=1, keepdims=True) * scales / 2 + 1e-4 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound)
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound.max(axis=1)
    assert (got.argmax(1) == want.argmax(1))[clear].all()


def test_quantize_lm_head_without_quantization_is_refused():
    with pytest.raises(ValueError, match="quantize_lm_head=True .* quantization is None; set quantization"):
        EngineConfig(model="m", quantize_lm_head=True)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("quantization", ["int8", "int4-g32"])
def test_the_declared_model_holds_what_the_loader_quantizes(tmp_path, tied, quantization):
    """`cbjax plan` and `cbjax lower` count and lower the model declare_quantized declares: with lm_head, the same
    names, shapes and dtypes as the loader's quantize_lm_head model (a tied embedding as the head's kernel)."""
    write_tiny_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    checkpoint = convert_checkpoint(import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf"), tmp_path / "float")
    loaded, config = load_model(checkpoint, quantization=quantization, fused_projections=True, quantize_lm_head=True)
    declared = nnx.eval_shape(lambda: declare_quantized(
        model_class(config)(config, dtype=jnp.float32, rngs=nnx.Rngs(0), fused_projections=True), quantization, lm_head=True))

    def leaves(model):
        return {path: (variable.shape, variable.dtype) for path, variable in nnx.to_flat_state(nnx.state(model))}

    assert leaves(declared) == leaves(loaded)
    head = ("model", "embed_tokens", "embedding") if tied else ("lm_head", "kernel")
    assert leaves(declared)[head][1] == (jnp.int8 if quantization == "int8" else jnp.uint8)


def test_plan_counts_a_quantized_lm_head_and_refuses_it_under_tensor_parallelism():
    from cbjax.plan.accelerators import accelerator
    from cbjax.plan.capacity import load_model_config, plan_capacity

    name, config = load_model_config("llama-3-8b")
    h100 = accelerator("h100")
    float_head = plan_capacity(name, config, h100, 1, max_model_len=8192, quantization="int8")
    int8_head = plan_capacity(name, config, h100, 1, max_model_len=8192, quantization="int8", quantize_lm_head=True)
    # Llama-3-8B's untied head [4096, 128256]: bf16 (2 bytes a weight) -> int8 (1 byte) and a float32 scale a column.
    assert int8_head.weight_bytes_per_device == float_head.weight_bytes_per_device - 4096 * 128256 + 4 * 128256
    with pytest.raises(ValueError, match="quantize_lm_head=True needs .* one device .*tensor_parallel_size=2"):
        plan_capacity(name, config, h100, 2, quantization="int8", quantize_lm_head=True)


def test_lower_takes_the_quantized_lm_head(tmp_path, capsys):
    """`cbjax lower --quantize-lm-head` lowers the steps of the declared model (a tied embedding held int8, as the
    head's [hidden, vocab] kernel) for CUDA, and refuses the flag under tensor parallelism as the engine does."""
    from cbjax.entrypoints.cli.main import main

    write_tiny_llama_gguf(tmp_path / "tiny.gguf", tied=True)
    hf_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    args = ["lower", "--config", str(hf_dir), "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--max-model-len", "64",
            "--quantization", "int8", "--quantize-lm-head"]
    main(args)
    assert "lowered 2/2 steps for cuda with backend pallas at tensor_parallel_size=1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="quantize_lm_head=True needs"):
        main([*args, "--tensor-parallel-size", "2"])
