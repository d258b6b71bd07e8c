"""The weights' vectors travel into a step stacked (worker/weight_stacks.py): which ones, and that the
step sees every weight as it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.worker.weight_stacks import WeightStacks
from tiny_llm import llm  # noqa: F401


def random_weights() -> list[jax.Array]:
    rng = np.random.default_rng(0)
    shapes_dtypes = [((4,), jnp.float32), ((2, 2), jnp.float32), ((4,), jnp.float32), ((4,), jnp.bfloat16),
                     ((4,), jnp.float32), ((3,), jnp.float32), ((2, 2), jnp.float32), ((4,), jnp.bfloat16)]
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape, dtype in shapes_dtypes]


def test_vectors_alike_in_shape_and_dtype_are_stacked_in_the_place_of_the_first():
    weights = random_weights()
    stacks = WeightStacks.of(weights)
    # Hand-worked: the three float32 [4] (0, 2, 4) and the two bfloat16 [4] (3, 7) stack; the float32
    # [3] is alone; the [2, 2] matrices (1 and 6) are alike but not vectors.
    assert stacks.entries == ((0, 2, 4), 1, (3, 7), 5, 6)
    step_weights = stacks.stack(weights)
    assert [w.shape for w in step_weights] == [(3, 4), (2, 2), (2, 4), (3,), (2, 2)]
    assert step_weights[3] is weights[5]  # a weight that travels alone is the same array, not a copy


def test_unstacking_gives_every_weight_back_in_order_inside_a_jitted_function():
    weights = random_weights()
    stacks = WeightStacks.of(weights)
    back = jax.jit(stacks.unstack)(stacks.stack(weights))
    assert len(back) == len(weights)
    for got, want in zip(back, weights):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_nothing_alike_means_nothing_stacked_and_a_wrong_count_is_refused():
    weights = random_weights()[:2]
    stacks = WeightStacks.of(weights)
    assert stacks.entries == (0, 1)
    with pytest.raises(ValueError, match="3 weights given; these stacks were planned for 2"):
        stacks.stack(random_weights()[:3])


def test_the_engine_passes_the_norm_vectors_of_every_layer_as_one_array(llm):
    """A tiny Llama (no biases): its layers' two norms and the final norm ([hidden] each) travel as
    one stack, every other weight as one array (the engine's outputs are checked against HF elsewhere)."""
    runner, config = llm.llm_engine.runner, llm.llm_engine.model_config
    stacked = [entry for entry in runner.weight_stacks.entries if isinstance(entry, tuple)]
    assert [len(entry) for entry in stacked] == [2 * config.num_hidden_layers + 1]
    assert len(runner.step_weights) == len(runner.weights) - 2 * config.num_hidden_layers
    assert runner.step_weights[runner.weight_stacks.entries.index(stacked[0])].shape == (len(stacked[0]), config.hidden_size)


def test_shapes_alone_stack_into_the_shape_of_the_stack():
    """An abstract runner (lowering a model never loaded) holds ShapeDtypeStructs, some with no sharding."""
    shapes = [jax.ShapeDtypeStruct((6,), jnp.bfloat16), jax.ShapeDtypeStruct((6, 6), jnp.bfloat16),
              jax.ShapeDtypeStruct((6,), jnp.bfloat16)]
    stacks = WeightStacks.of(shapes)
    assert stacks.entries == ((0, 2), 1)
    stacked = stacks.stack(shapes)
    assert (stacked[0].shape, stacked[0].dtype, stacked[1]) == ((2, 6), jnp.bfloat16, shapes[1])
