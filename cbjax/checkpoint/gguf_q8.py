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
  Q3_K (110-byte superblocks of 256: 32 bytes of high bits, 64 of low bit pairs, 12 of 6-bit sc_j, d; 16 sub-blocks
        of 16):                                                w = d (sc_j - 32) q    -> q (-4..3),
                                                                                          scales d (sc_j - 32) (G 16)
  Q2_K (84-byte superblocks of 256: 16 bytes of 4-bit sc_j and m_j, 64 of bit pairs, d, dmin; 16 sub-blocks of 16):
                                                               w = d sc_j q - dmin m_j -> q (0..3), scales d sc_j,
                                                                                          mins -dmin m_j     (G 16)
  IQ4_NL (18-byte blocks of 32: d, 16 bytes of nibbles), IQ4_XS (136-byte superblocks of 256: d, 8 6-bit ls_j,
        128 bytes of nibbles): w = d kvalues[q] (IQ4_XS: d (ls_j - 32) kvalues[q]), kvalues 16 int8 steps of a
        non-linear grid                                      -> kvalues[q], scales d (d (ls_j - 32)) (G 32)
Q5_0 and Q5_1 are what llama.cpp writes where a K-quant's superblock of 256 does not divide a row (its Q4_K_M
and Q5_K_M of SmolLM2: every projection but the down ones); held as int8 they take 1.125 (1.25 with mins) bytes
a weight against the file's 0.69 (0.75) and float32's 4, and run the int8 kernel. The 2- and 3-bit types (Q2_K,
Q3_K: llama.cpp's smallest files) take more bytes as int8 than in the file (1.125-1.5 a weight against 0.33-0.44),
a third of float32's. IQ4_NL and IQ4_XS are held as 4-bit nibbles indexing their grid (gguf_forms.py,
`gguf_iq4_indices`), and as int8 (their grid's values) only in a fused kernel beside other types.
(llama.cpp's ggml-quants.c; the `gguf` package's dequantize is the reference the tests hold them to: it forms
d * sc_j in float32 first too, so the two products are the same float32 numbers.)
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL, Q4_K
from jaxtyping import Float, Int8, UInt8

Q = GGMLQuantizationType
# The int8 group size of each type kept as int8, and the types whose groups carry mins beside their scales.
INT8_GROUPS = {Q.Q8_0: 32, Q.Q6_K: 16, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q5_K: 32, Q.Q3_K: 16, Q.Q2_K: 16, Q.IQ4_NL: 32,
               Q.IQ4_XS: 32}
WITH_MINS = (Q.Q5_1, Q.Q5_K, Q.Q2_K)
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q6_K: 210, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q5_K: 176, Q.Q3_K: 110, Q.Q2_K: 84, Q.IQ4_NL: 18,
                Q.IQ4_XS: 136}
IQ4_VALUES = np.array(IQ4_NL.kvalues, np.int8)  # the 16 steps IQ4_NL's and IQ4_XS's nibbles index


def _f16(blocks: UInt8[np.ndarray, "blocks nbytes"], column: int) -> Float[np.ndarray, "blocks 1"]:
    """Each block's float16 at byte `column`, as float32."""
    return blocks[:, column : column + 2].copy().view(np.float16).astype(np.float32)


def _bits(packed: UInt8[np.ndarray, "blocks rows width"], width: int, count: int) -> UInt8[np.ndarray, "blocks values"]:
    """Fields of `width` bits of each byte of `packed`, the lowest first: for each row of bytes its `count` fields
    in turn, each taken from every byte of the row (ggml's order of a superblock's values)."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(1, 1, count, 1)
    return ((packed[:, :, None, :] >> shifts) & ((1 << width) - 1)).reshape(packed.shape[0], -1)


def _q8_0(blocks):
    return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None


def _q6_k(blocks):
    """128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sc_j, d: each half (128 values) takes 64 bytes of the
    nibbles (low, then high) and 32 of the pairs (bits 0-1, 2-3, 4-5, 6-7 in turn); values less 32."""
    low, high = _bits(blocks[:, :128].reshape(-1, 2, 64), 4, 2), _bits(blocks[:, 128:192].reshape(-1, 2, 32), 2, 4)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return q, _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32), None


def _q5_values(qh: UInt8[np.ndarray, "blocks 4"], qs: UInt8[np.ndarray, "blocks 16"]) -> Int8[np.ndarray, "blocks 32"]:
    """A Q5_0 or Q5_1 block's 32 five-bit values (0..31): value j < 16 is qs[j]'s low nibble, value j + 16 its
    high one, and bit j of the little-endian uint32 qh is value j's fifth bit."""
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8)


def _q5_0(blocks):
    return _q5_values(blocks[:, 2:6], blocks[:, 6:]) - np.int8(16), _f16(blocks, 0), None


def _q5_1(blocks):
    return _q5_values(blocks[:, 4:8], blocks[:, 8:]), _f16(blocks, 0), _f16(blocks, 2)


def _q5_k(blocks):
    """d, dmin, 12 bytes of 6-bit sc_j and m_j (Q4_K's), 32 bytes of fifth bits, 128 of nibbles: sub-block j of 32
    takes byte row j // 2 of the nibbles (low for even j, high for odd) and bit j of the fifth bits' 32 bytes."""
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    low = _bits(blocks[:, 48:].reshape(-1, 4, 32), 4, 2)
    high = _bits(blocks[:, 16:48].reshape(-1, 1, 32), 1, 8)
    scales, mins = _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * m.astype(np.float32))
    return (low | (high << 4)).astype(np.int8), scales, mins


def _q3_k(blocks):
    """32 bytes of high bits, 64 of low bit pairs, 12 of 6-bit sc_j, d: sub-blocks of 16 in pairs of bit-pair rows;
    the value is its pair less 4 where its high bit is 0 (-4..3); sc_j's low nibbles in bytes 0-7, high pairs in 8-11."""
    low = _bits(blocks[:, 32:96].reshape(-1, 2, 32), 2, 4)
    high = _bits(blocks[:, :32].reshape(-1, 1, 32), 1, 8)
    q = low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)
    sc = _bits(blocks[:, 96:104].reshape(-1, 1, 8), 4, 2) | (_bits(blocks[:, 104:108].reshape(-1, 1, 4), 2, 4) << 4)
    return q, _f16(blocks, 108) * (sc.astype(np.int8) - np.int8(32)).astype(np.float32), None


def _q2_k(blocks):
    """16 bytes of sc_j (low nibble) and m_j (high), 64 of bit pairs, d, dmin: sub-blocks of 16, in two rows of 32
    bytes read four pairs deep."""
    sc = blocks[:, :16]
    q = _bits(blocks[:, 16:80].reshape(-1, 2, 32), 2, 4).astype(np.int8)
    return q, _f16(blocks, 80) * (sc & 0x0F).astype(np.float32), -(_f16(blocks, 82) * (sc >> 4).astype(np.float32))


def _iq4_nl_indices(blocks):
    """d, 16 bytes of nibbles (low, then high): each value's index into IQ4_VALUES, and d."""
    return _bits(blocks[:, None, 2:], 4, 2), _f16(blocks, 0)


def _iq4_xs_indices(blocks):
    """d, 2 bytes of ls_j's high bit pairs, 4 of their low nibbles, 128 of nibbles (16 bytes a sub-block of 32: low
    nibbles, then high): each value's index into IQ4_VALUES, and d (ls_j - 32) per sub-block."""
    ls = _bits(blocks[:, 4:8].reshape(-1, 1, 4), 4, 2).reshape(-1, 2, 4).transpose(0, 2, 1).reshape(-1, 8)
    ls |= (blocks[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))).astype(np.uint8) % 4 << 4
    return _bits(blocks[:, 8:].reshape(-1, 8, 16), 4, 2), _f16(blocks, 0) * (ls.astype(np.int8) - np.int8(32)).astype(np.float32)


def _iq4_nl(blocks):
    indices, scales = _iq4_nl_indices(blocks)
    return IQ4_VALUES[indices], scales, None


def _iq4_xs(blocks):
    indices, scales = _iq4_xs_indices(blocks)
    return IQ4_VALUES[indices], scales, None


_UNPACK = {Q.Q8_0: _q8_0, Q.Q6_K: _q6_k, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q5_K: _q5_k, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k,
           Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}


_INDICES = {Q.IQ4_NL: _iq4_nl_indices, Q.IQ4_XS: _iq4_xs_indices}


def gguf_iq4_indices(
    data: UInt8[np.ndarray, "rows nbytes"], qtype: GGMLQuantizationType, k: int,
) -> tuple[UInt8[np.ndarray, "rows k"], Float[np.ndarray, "rows groups"]]:
    """An IQ4_NL or IQ4_XS tensor's raw rows -> (each value's index into IQ4_VALUES [rows, k], float32 scales
    [rows, k / 32]) with w = IQ4_VALUES[index] * scales per group: the file's own nibbles (gguf_forms.py holds
    them as 4-bit nibbles indexing that grid)."""
    if qtype not in _INDICES:
        raise ValueError(f"GGUF type {qtype.name} does not index IQ4's grid; those that do are {[t.name for t in _INDICES]}")
    indices, scales = _INDICES[qtype](np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[qtype]))
    return indices.reshape(data.shape[0], k), scales.reshape(data.shape[0], k // INT8_GROUPS[qtype])


def gguf_int8_groups(
    data: UInt8[np.ndarray, "rows nbytes"], qtype: GGMLQuantizationType, k: int,
) -> tuple[Int8[np.ndarray, "rows k"], Float[np.ndarray, "rows groups"], Float[np.ndarray, "rows groups"] | None]:
    """A tensor of a type in INT8_GROUPS, its raw rows (one output row of `k` inputs each) -> (int8 q [rows, k],
    float32 scales [rows, k / G], and mins alike for WITH_MINS types, else None) with w = q * scales (+ mins) per
    group of G: the file's own integers."""
    if qtype not in INT8_GROUPS:
        raise ValueError(f"GGUF type {qtype.name} is not kept as int8; kept as int8 are {[t.name for t in INT8_GROUPS]}")
    rows, groups = data.shape[0], k // INT8_GROUPS[qtype]
    q, scales, mins = _UNPACK[qtype](np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[qtype]))
    return q.reshape(rows, k), scales.reshape(rows, groups), None if mins is None else mins.reshape(rows, groups)
