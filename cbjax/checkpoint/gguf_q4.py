"""GGUF's 4-bit tensors as the engine's 4-bit form (kernels_cpu/quant4.py: w = scales * q + mins per group of
32 inputs, q in 0..15), with the same bits: each block's nibbles are moved, never dequantized, and its
float16 factors become float32 scales and mins.

  Q4_0 (18-byte blocks of 32): w = d (q - 8)              -> scales d,        mins -8 d
  Q4_1 (20-byte blocks of 32): w = d q + m                -> scales d,        mins m
  Q4_K (144-byte superblocks of 256, 8 sub-blocks of 32 with 6-bit sc_j, m_j):
                               w = d sc_j q - dmin m_j    -> scales d sc_j,   mins -dmin m_j
(llama.cpp's ggml-quants.c; the `gguf` package's dequantize is the reference the tests hold them to.)
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from jaxtyping import Float, UInt8

GROUP = 32  # every 4-bit GGUF type scales groups of 32 inputs
STORED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def _halves(packed: UInt8[np.ndarray, "blocks chunks half"]) -> UInt8[np.ndarray, "blocks values"]:
    """Each chunk's low nibbles, then its high nibbles: ggml's order of a block's values."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def gguf_q4_groups(
    data: UInt8[np.ndarray, "rows nbytes"], qtype: GGMLQuantizationType, k: int,
) -> tuple[UInt8[np.ndarray, "rows k"], Float[np.ndarray, "rows groups"], Float[np.ndarray, "rows groups"]]:
    """A 4-bit GGUF tensor's raw rows (one output row of `k` inputs each) -> (q [rows, k] in 0..15, float32
    scales and mins [rows, k / 32]) with w = scales * q + mins per group: the file's own q, unrounded."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, {GGMLQuantizationType.Q4_K: 144,
                                                   GGMLQuantizationType.Q4_1: 20}.get(qtype, 18))
    f16 = lambda column: blocks[:, column : column + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    if qtype == GGMLQuantizationType.Q4_0:
        d = f16(0)
        q, scales, mins = _halves(blocks[:, None, 2:]), d, -8 * d
    elif qtype == GGMLQuantizationType.Q4_1:
        q, scales, mins = _halves(blocks[:, None, 4:]), f16(0), f16(2)
    elif qtype == GGMLQuantizationType.Q4_K:
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        q = _halves(blocks[:, 16:].reshape(-1, 4, 32))
        scales, mins = f16(0) * sc.astype(np.float32), -(f16(2) * m.astype(np.float32))
    else:
        raise ValueError(f"GGUF type {qtype.name} is not 4-bit; stored as 4-bit are {[t.name for t in STORED_TYPES]}")
    return q.reshape(rows, k), scales.reshape(rows, k // GROUP), mins.reshape(rows, k // GROUP)
