"""Which attention implementation runs: chosen once at start-up, logged once.

Backends:
  "xla"              the jnp reference (the CPU serving default)
  "pallas"           compiled Pallas kernels, Triton lowering (GPU)
  "pallas_interpret" the same kernels interpreted on CPU (tests; slow)
"""

from __future__ import annotations

import logging

from jaxtyping import Array, Float

from kernels_pallas.reference import (
    AttentionMetadata,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

logger = logging.getLogger(__name__)

BACKENDS = ("xla", "pallas", "pallas_interpret")


def resolve_backend(requested: str = "auto") -> str:
    """Turn a user's choice ("auto" included) into one of BACKENDS, and log it once."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend={requested!r} is not one of {('auto', *BACKENDS)}")
    chosen = "xla" if requested == "auto" else requested
    logger.info("attention backend: %s (requested %s)", chosen, requested)
    return chosen


def attention(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    *,
    backend: str,
    decode_only: bool,
) -> Float[Array, "tokens q_heads dim"]:
    """Paged attention of one step's tokens. `decode_only`: token r belongs to request r."""
    if backend == "xla":
        if decode_only:
            return paged_decode_attention_reference(
                q, k_pages, v_pages, metadata.seq_lens, metadata.block_tables, sm_scale
            )
        return ragged_paged_attention_reference(q, k_pages, v_pages, metadata, sm_scale)
    raise NotImplementedError(f"attention backend {backend!r} is not built yet")
