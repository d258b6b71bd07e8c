"""A quantized embedding (cbjax/models/layers/embedding.py) kept as its head's kernel [hidden, vocab]: the rows
it gathers are the float64 dequantization of that kernel's columns, in every form (int8 per column, int8 in
groups, 4-bit with mins), unpacked or in the C++ kernel's panels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.models.layers.embedding import dequantized_columns
from kernels_cpu import pack_group_rows, pack_weight
from kernels_cpu.quant import quantize_int8
from kernels_cpu.quant4 import dequantize_int4, quantize_int4


def _int8_groups(rng: np.random.Generator, hidden: int, vocab: int, group: int):
    q = rng.integers(-127, 128, (hidden, vocab), dtype=np.int8)
    scales = rng.uniform(1e-3, 1e-1, (hidden // group, vocab)).astype(np.float32)
    return (q, scales), q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, axis=0)


# (form, layout): unpacked, in panels, or in panels with 4-bit scales and mins packed by panel as well (the
# engine's form where the width is whole panels: linear.pack_scales_beside)
LAYOUTS = [(form, layout) for form in ("int8", "int8-g16", "int4-g32") for layout in ("unpacked", "panels")]


@pytest.mark.parametrize("form,layout", [*LAYOUTS, ("int4-g32", "panels, scales by panel")])
def test_gathered_rows_are_the_dequantized_kernels_columns(form, layout):
    rng = np.random.default_rng()
    hidden, vocab = 64, 96 if layout == "panels, scales by panel" else 70  # 70: a last panel of 6 columns
    if form == "int8":
        q, scales = quantize_int8(rng.standard_normal((hidden, vocab)).astype(np.float32))
        leaves, reference = (q, scales), q.astype(np.float64) * scales
    elif form == "int8-g16":
        leaves, reference = _int8_groups(rng, hidden, vocab, 16)
    else:
        leaves = quantize_int4(rng.standard_normal((hidden, vocab)).astype(np.float32), 32)
        reference = dequantize_int4(*leaves)
    kernel, *quantized = leaves
    token_ids = rng.integers(0, vocab, 9)
    token_ids[:2] = (0, vocab - 1)
    if layout == "panels, scales by panel":
        quantized = [pack_group_rows(leaf) for leaf in quantized]
    rows = dequantized_columns(jnp.asarray(kernel if layout == "unpacked" else pack_weight(kernel)),
                               [jnp.asarray(leaf) for leaf in quantized], jnp.asarray(token_ids))
    assert rows.shape == (9, hidden) and rows.dtype == jnp.float32
    # q * scale (+ min) once in float32: within one float32 rounding of the float64 value
    np.testing.assert_allclose(np.asarray(rows, np.float64), reference[:, token_ids].T, rtol=2**-23, atol=1e-30 + 2**-23 * np.abs(reference).max())
