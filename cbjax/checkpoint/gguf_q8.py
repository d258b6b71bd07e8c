"""GGUF's 8-, 6- and 5-bit tensors as the engine's int8 group form (kernels_cpu/quant.py: w[k, n] = q[k, n] *
scales[k // G, n], q int8), with the same bits: each block's integers are moved, never dequantized, and its
float16 factors become float32 scales.

  Q8_0 (34-byte blocks of 32: d, 32 int8 q):                  w = d q                -> q,      scales d        (G 32)
  Q6_K (210-byte superblocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sc_j, d;
        16 sub-blocks of 16):                                  w = d sc_j (q - 32)    -> q - 32, scales d sc_j   (G 16)
  Q5_0 (22-byte blocks of 32: d, 32 high bits, 16 bytes of low nibbles):
                                                               w = d (q - 16)         -> q - 16, scales d        (G 32)
Q5_0 is what llama.cpp writes where a K-quant's superblock of 256 does not divide a row (its Q4_K_M of
SmolLM2: every projection but the down ones); held as int8 it takes 1.125 bytes a weight against the file's
0.69 and float32's 4, and runs the int8 kernel.
(llama.cpp's ggml-quants.c; the `gguf` package's dequantize is the reference the tests hold them to: it forms
d * sc_j in float32 first too, so the two products are the same float32 numbers.)
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from jaxtyping import Float, Int8, UInt8

# The int8 group size of each type kept as int8.
INT8_GROUPS = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q6_K: 16, GGMLQuantizationType.Q5_0: 32}
_BLOCK_BYTES = {GGMLQuantizationType.Q8_0: 34, GGMLQuantizationType.Q6_K: 210, GGMLQuantizationType.Q5_0: 22}


def _q6_k_values(ql: UInt8[np.ndarray, "blocks 128"], qh: UInt8[np.ndarray, "blocks 64"]) -> Int8[np.ndarray, "blocks 256"]:
    """A Q6_K superblock's 256 six-bit values, less 32, in ggml's order: each half (128 values) takes 64 bytes
    of `ql` (low nibbles, then high nibbles) and 32 bytes of `qh` (bit pairs 0-1, 2-3, 4-5, 6-7 in turn)."""
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(np.int8) - np.int8(32)


def _q5_0_values(qh: UInt8[np.ndarray, "blocks 4"], qs: UInt8[np.ndarray, "blocks 16"]) -> Int8[np.ndarray, "blocks 32"]:
    """A Q5_0 block's 32 five-bit values, less 16: value j < 16 is qs[j]'s low nibble, value j + 16 its high one,
    and bit j of the little-endian uint32 qh is value j's fifth bit."""
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)


def gguf_int8_groups(
    data: UInt8[np.ndarray, "rows nbytes"], qtype: GGMLQuantizationType, k: int,
) -> tuple[Int8[np.ndarray, "rows k"], Float[np.ndarray, "rows groups"]]:
    """A Q8_0, Q6_K or Q5_0 tensor's raw rows (one output row of `k` inputs each) -> (int8 q [rows, k], float32
    scales [rows, k / G]) with w = q * scales per group of G (INT8_GROUPS): the file's own integers."""
    if qtype not in INT8_GROUPS:
        raise ValueError(f"GGUF type {qtype.name} is not kept as int8; kept as int8 are {[t.name for t in INT8_GROUPS]}")
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[qtype])
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0):  # d first, then the block's values
        scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8) if qtype == GGMLQuantizationType.Q8_0 else _q5_0_values(blocks[:, 2:6], blocks[:, 6:])
    else:
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        q = _q6_k_values(blocks[:, :128], blocks[:, 128:192])
        scales = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(rows, k), scales.reshape(rows, k // INT8_GROUPS[qtype])


def gguf_int8_kernel(
    data: UInt8[np.ndarray, "out nbytes"], qtype: GGMLQuantizationType, k: int, column_order: np.ndarray | None = None,
) -> tuple[Int8[np.ndarray, "k out"], Float[np.ndarray, "groups out"]]:
    """A Q8_0, Q6_K or Q5_0 tensor [out, k] as an [in, out] kernel's int8 q [k, out] and scales [k / G, out];
    `column_order` reorders the output columns (llama.cpp's Q/K rope rows)."""
    q, scales = gguf_int8_groups(data, qtype, k)
    order = slice(None) if column_order is None else column_order
    return np.ascontiguousarray(q[order].T), np.ascontiguousarray(scales[order].T)
