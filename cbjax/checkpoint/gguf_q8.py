"""GGUF's 8-, 6- and 5-bit tensors as the engine's int8 group form (kernels_cpu/quant.py: w[k, n] = q[k, n] *
scales[k // G, n] (+ mins[k // G, n]), q int8), with the same bits: each block's integers are moved, never
dequantized, and its float16 factors become float32 scales (and mins).

  Q8_0 (34-byte blocks of 32: d, 32 int8 q):                  w = d q                -> q,      scales d        (G 32)
  Q6_K (210-byte superblocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sc_j, d;
        16 sub-blocks of 16):                                  w = d sc_j (q - 32)    -> q - 32, scales d sc_j   (G 16)
  Q5_0 (22-byte blocks of 32: d, 32 high bits, 16 bytes of low nibbles):
                                                               w = d (q - 16)         -> q - 16, scales d        (G 32)
  Q5_1 (24-byte blocks of 32: d, m, 32 high bits, 16 bytes of low nibbles):
                                                               w = d q + m            -> q, scales d, mins m     (G 32)
  Q5_K (176-byte superblocks of 256: d, dmin, 12 bytes of 6-bit sc_j and m_j as Q4_K's, 32 bytes of high bits,
        128 of low nibbles; 8 sub-blocks of 32):              w = d sc_j q - dmin m_j -> q, scales d sc_j,
                                                                                          mins -dmin m_j     (G 32)
Q5_0 and Q5_1 are what llama.cpp writes where a K-quant's superblock of 256 does not divide a row (its Q4_K_M
and Q5_K_M of SmolLM2: every projection but the down ones); held as int8 they take 1.125 (1.25 with mins) bytes
a weight against the file's 0.69 (0.75) and float32's 4, and run the int8 kernel.
(llama.cpp's ggml-quants.c; the `gguf` package's dequantize is the reference the tests hold them to: it forms
d * sc_j in float32 first too, so the two products are the same float32 numbers.)
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from jaxtyping import Float, Int8, UInt8

Q = GGMLQuantizationType
# The int8 group size of each type kept as int8, and the types whose groups carry mins beside their scales.
INT8_GROUPS = {Q.Q8_0: 32, Q.Q6_K: 16, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q5_K: 32}
WITH_MINS = (Q.Q5_1, Q.Q5_K)
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q6_K: 210, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q5_K: 176}


def _q6_k_values(ql: UInt8[np.ndarray, "blocks 128"], qh: UInt8[np.ndarray, "blocks 64"]) -> Int8[np.ndarray, "blocks 256"]:
    """A Q6_K superblock's 256 six-bit values, less 32, in ggml's order: each half (128 values) takes 64 bytes
    of `ql` (low nibbles, then high nibbles) and 32 bytes of `qh` (bit pairs 0-1, 2-3, 4-5, 6-7 in turn)."""
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
    return (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(np.int8) - np.int8(32)


def _q5_values(qh: UInt8[np.ndarray, "blocks 4"], qs: UInt8[np.ndarray, "blocks 16"]) -> Int8[np.ndarray, "blocks 32"]:
    """A Q5_0 or Q5_1 block's 32 five-bit values (0..31): value j < 16 is qs[j]'s low nibble, value j + 16 its
    high one, and bit j of the little-endian uint32 qh is value j's fifth bit."""
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8)


def _q5_k_values(qh: UInt8[np.ndarray, "blocks 32"], qs: UInt8[np.ndarray, "blocks 128"]) -> Int8[np.ndarray, "blocks 256"]:
    """A Q5_K superblock's 256 five-bit values (0..31), sub-block j of 32 after j - 1: its low nibbles are byte
    row j // 2 of `qs` (32 bytes a row; low nibbles for even j, high for odd), its fifth bits bit j of `qh`'s 32."""
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(np.int8)


def gguf_int8_groups(
    data: UInt8[np.ndarray, "rows nbytes"], qtype: GGMLQuantizationType, k: int,
) -> tuple[Int8[np.ndarray, "rows k"], Float[np.ndarray, "rows groups"], Float[np.ndarray, "rows groups"] | None]:
    """A Q8_0, Q6_K, Q5_0, Q5_1 or Q5_K tensor's raw rows (one output row of `k` inputs each) -> (int8 q [rows, k],
    float32 scales [rows, k / G], and mins alike for WITH_MINS types, else None) with w = q * scales (+ mins) per
    group of G (INT8_GROUPS): the file's own integers."""
    if qtype not in INT8_GROUPS:
        raise ValueError(f"GGUF type {qtype.name} is not kept as int8; kept as int8 are {[t.name for t in INT8_GROUPS]}")
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[qtype])
    f16 = lambda column: blocks[:, column : column + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    mins = None
    if qtype == Q.Q8_0:
        q, scales = blocks[:, 2:].view(np.int8), f16(0)
    elif qtype == Q.Q5_0:
        q, scales = _q5_values(blocks[:, 2:6], blocks[:, 6:]) - np.int8(16), f16(0)
    elif qtype == Q.Q5_1:
        q, scales, mins = _q5_values(blocks[:, 4:8], blocks[:, 8:]), f16(0), f16(2)
    elif qtype == Q.Q5_K:
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        q = _q5_k_values(blocks[:, 16:48], blocks[:, 48:])
        scales, mins = f16(0) * sc.astype(np.float32), -(f16(2) * m.astype(np.float32))
    else:
        q = _q6_k_values(blocks[:, :128], blocks[:, 128:192])
        scales = f16(208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    groups = k // INT8_GROUPS[qtype]
    return q.reshape(rows, k), scales.reshape(rows, groups), None if mins is None else mins.reshape(rows, groups)
