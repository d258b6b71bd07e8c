"""The token embedding kept quantized, as its LM head's kernel (issue 38): a GGUF file's Q8_0 table, or a
quantized head (`quantize_lm_head`), is held once, as the [hidden, vocab] kernel the head multiplies
(int8 q with scales [vocab] or [hidden / G, vocab] and maybe mins alike, or 4-bit nibbles with scales and mins
[hidden / G, vocab] and maybe a grid; unpacked, or in 32-column panels for the C++ matmul). The head multiplies it as any quantized projection
(layers/linear.kernel_product); the embedding gathers the columns of the tokens it looks up and dequantizes
only those: never a float copy of the table.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.models.layers.linear import beside_values
from kernels_cpu.matmul import PANEL


def quantized_table(embed: nnx.Embed) -> tuple[Array, list[Array]]:
    """The embedding's weight and the quantized leaves beside it (none for a float [vocab, hidden] table)."""
    table = embed.embedding[...]
    return table, beside_values(embed)


def embedding_rows(embed: nnx.Embed, token_ids: Int[Array, "tokens"]) -> Float[Array, "tokens hidden"]:
    """The rows of `token_ids`: a float table's own rows, a quantized one's dequantized to float32."""
    table, quantized = quantized_table(embed)
    return table[token_ids] if not quantized else dequantized_columns(table, quantized, token_ids)


def dequantized_columns(
    kernel: Array, quantized: list[Array], columns: Int[Array, "tokens"],
) -> Float[Array, "tokens hidden"]:
    """Columns `columns` of a quantized [in, out] kernel (int8 [in, out] or nibbles [in / 2, out], or their
    panels [ceil(out / 32), ., 32]) with its scales (and mins, unpacked or packed by panel; and a grid [16] its
    nibbles index), dequantized to float32, one row per column."""
    if kernel.ndim == 3:  # panel p holds columns 32p..32p+31
        q = kernel[columns // PANEL, :, columns % PANEL]
    else:
        q = kernel[:, columns].T
    if kernel.dtype == jnp.uint8:  # byte s holds inputs 2s (low nibble) and 2s + 1 (high)
        q = jnp.stack([q & 0x0F, q >> 4], axis=-1).reshape(q.shape[0], -1)
    grid = quantized[2] if len(quantized) == 3 else None  # (scales, mins, grid): linear.BESIDE's order
    q = q if grid is None else grid.astype(jnp.float32)[q]
    scales, *mins = (leaf[columns // PANEL, :, columns % PANEL].T if leaf.ndim == 3 else leaf[..., columns]
                     for leaf in quantized[:2])  # 3-D: 4-bit scales or mins packed by panel (kernels_cpu.pack_group_rows)
    if scales.ndim == 1:  # int8 per output column
        return q.astype(jnp.float32) * scales[:, None]
    group = q.shape[1] // scales.shape[0]
    w = q.astype(jnp.float32) * jnp.repeat(scales.T, group, axis=1)
    return w if not mins else w + jnp.repeat(mins[0].T, group, axis=1)
