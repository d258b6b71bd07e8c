"""The structured-output mask on device: a packed bitmask [rows, ceil(V/32)] int32 (bit j of word w allows
token 32w + j, llguidance's layout) unpacked inside the step; a disallowed token's logit becomes -inf.

Layout: a narrow per-request column of mask row indices (-1: unconstrained) and a separate mask array of
constrained rows, so a batch without a constrained request carries no full-vocabulary column."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int32

_BITS = 32


def unpack_bitmask(bitmask: Int32[Array, "M W"], vocab: int) -> Bool[Array, "M V"]:
    """Bool [M, vocab]: True where the packed mask allows the token; ids past 32 * W are disallowed."""
    shifts = jnp.arange(_BITS, dtype=jnp.int32)
    bits = (jnp.right_shift(bitmask[:, :, None], shifts) & 1).reshape(bitmask.shape[0], -1).astype(bool)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return jnp.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))


def apply_grammar_bitmask(logits: Float[Array, "S V"], mask_rows: Int32[Array, "S"],
                          bitmask: Int32[Array, "M W"]) -> Float[Array, "S V"]:
    """Row s keeps logits[s] where bitmask[mask_rows[s]] allows the token (-inf elsewhere); mask_rows -1: untouched."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])[jnp.clip(mask_rows, 0, bitmask.shape[0] - 1)]
    return jnp.where((mask_rows[:, None] >= 0) & ~allowed, -jnp.inf, logits)
