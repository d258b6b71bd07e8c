"""Which attention implementation runs: chosen once at start-up, logged once.

Backends:
  "cpp"              the C++ kernel of kernels_cpu, an XLA FFI custom call (the CPU serving default)
  "xla"              the jnp reference (any platform; the fallback)
  "pallas"           compiled Pallas kernels, Triton lowering (GPU)
  "pallas_interpret" the same kernels interpreted on CPU (tests; slow)

"auto" takes "pallas" on a GPU once a probe has compiled and run both kernels
there (at the model's shapes when given); if that fails it warns with the
reason and takes "xla", which is correct but several times slower at prefill.
On a CPU "auto" takes "cpp" once the kernel is built and registered (it is
compiled on first use), else it warns with the reason and takes "xla".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float

from cbjax.models.layers.mesh import MODEL_AXIS
from kernels_cpu import kernel_problem, ragged_paged_attention_cpu, write_kv_and_attend_cpu
from kernels_pallas.paged_attention import check_kernel_shapes, paged_decode_attention
from kernels_pallas.ragged_attention import ragged_paged_attention
from kernels_pallas.reference import (
    AttentionMetadata,
    mixed_paged_attention_reference,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
    write_kv,
)

logger = logging.getLogger(__name__)

BACKENDS = ("xla", "cpp", "pallas", "pallas_interpret")
XLA_MIXED_BLOCK_Q = 16  # query tile of the jnp path for mixed (prefill) steps


def xla_mixed_block_q(num_tokens: int, num_reqs: int) -> int:
    """Query tile of the jnp path for a mixed step of this bucket's shape.

    Every request takes at least one tile, so a one-token decode pads its tile to block_q rows;
    prompt tokens share each gathered page across the tile. Per layer on XLA:CPU (SmolLM2
    shapes, float16 pool): a 512-token prefill ran 6.6 ms at 16 and 7.9 at 8, while 64 decodes
    beside a 448-token chunk ran 18.8 at 16 and 15.1 at 8, and 15 decodes beside a 100-token
    chunk 1.31 and 0.98. So 16 while the prompt tiles can outnumber the requests, else 8.
    """
    return XLA_MIXED_BLOCK_Q if num_tokens >= XLA_MIXED_BLOCK_Q * num_reqs else XLA_MIXED_BLOCK_Q // 2


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _probe_pallas(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Compile and run both kernels on the GPU at these shapes; the reason they can't be used, or None."""
    try:
        check_kernel_shapes(num_q_heads, num_kv_heads, head_dim, block_size)
        k_pages = jnp.zeros((num_kv_heads, 4, block_size, head_dim), jnp.bfloat16)
        q = jnp.ones((2, num_q_heads, head_dim), jnp.bfloat16)
        metadata = AttentionMetadata(
            slot_mapping=jnp.zeros((2,), jnp.int32),
            query_start_loc=jnp.array([0, 1, 2], jnp.int32),
            seq_lens=jnp.array([1, block_size + 1], jnp.int32),
            block_tables=jnp.array([[1, 0], [2, 3]], jnp.int32),
        )
        paged_decode_attention(q, k_pages, k_pages, metadata.seq_lens, metadata.block_tables, 1.0).block_until_ready()
        ragged_paged_attention(q, k_pages, k_pages, metadata, 1.0).block_until_ready()
    except Exception as e:  # noqa: BLE001 -- any failure means "don't use the kernels", and we report it
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def cpu_kernel_fallback(requested: str, problem: str) -> str:
    """The backend to serve with when the C++ kernel is unusable (`problem`): an error if the user
    asked for "cpp", else "xla" with a warning that says why."""
    if requested == "cpp":
        raise RuntimeError(f"attention_backend='cpp': the CPU kernel is unusable here ({problem})")
    warnings.warn(
        f"the C++ CPU attention kernel is unusable here ({problem}); serving with the jnp reference "
        "attention instead, which is correct but about 2-3x slower per layer. Pass attention_backend='xla' "
        "to silence this, or fix the cause above.",
        RuntimeWarning,
        stacklevel=3,
    )
    return "xla"


@functools.lru_cache(maxsize=None)
def resolve_backend(
    requested: str = "auto",
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    wait_for_kernel: bool = True,
) -> str:
    """Turn a user's choice ("auto" included) into one of BACKENDS, and log it once.

    The shapes are the model's; "auto" probes the Pallas kernels at them on a GPU. With
    wait_for_kernel=False, a C++ kernel still being built (kernels_cpu.register_in_background)
    counts as usable; whoever compiles a step first checks the build (cpu_kernel_fallback).
    Every backend has sliding-window attention, so a model's windows do not enter the choice.
    """
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention_backend={requested!r} is not one of {('auto', *BACKENDS)}")
    chosen = "xla" if requested == "auto" else requested
    platform = jax.devices()[0].platform
    if requested == "cpp" and platform != "cpu":
        raise ValueError(f"attention_backend='cpp' is the CPU kernel, but JAX runs on {platform}; use 'auto'")
    if requested in ("auto", "cpp") and platform == "cpu":
        problem = kernel_problem(wait=wait_for_kernel)
        chosen = "cpp" if problem is None else cpu_kernel_fallback(requested, problem)
    if requested == "pallas" and not _has_gpu():
        # Without a GPU the same kernels run interpreted: correct, slow, meant for testing.
        warnings.warn(
            f"attention_backend='pallas' on {jax.devices()[0].platform}: no CUDA GPU, so the Pallas kernels run "
            "interpreted (correct but slow, for testing); use 'xla' (the default here) to serve",
            RuntimeWarning,
            stacklevel=2,
        )
        chosen = "pallas_interpret"
    if requested == "auto" and _has_gpu():
        problem = _probe_pallas(num_q_heads, num_kv_heads, head_dim, block_size)
        if problem is None:
            chosen = "pallas"
        else:
            warnings.warn(
                f"Pallas attention kernels unusable on this GPU ({problem}); falling back to the XLA reference "
                "attention, which is correct but several times slower at prefill. "
                "Pass attention_backend='xla' to silence this, or fix the cause above.",
                RuntimeWarning,
                stacklevel=2,
            )
    logger.info("attention backend: %s (requested %s)", chosen, requested)
    return chosen


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one compiled step runs attention: static, fixed per bucket, passed down every layer.

    backend: one of BACKENDS. decode_only: token r belongs to request r. max_num_prefills: at most
    this many requests have 2+ tokens in the step (the scheduler's promise), so the jnp path runs
    one-token requests through its decode path (None: no bound).
    """

    backend: str = "xla"
    decode_only: bool = False
    max_num_prefills: int | None = None
    mesh: Mesh | None = None  # tensor parallel: heads and the pool split over its MODEL_AXIS
    expert_parallel: bool = False  # MoE experts placed whole over MODEL_AXIS, not split within (layers/moe.py)


def attention(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    plan: AttentionPlan,
    sliding_window: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Float[Array, "tokens q_heads dim"]:
    """Paged attention of one step's tokens, run as `plan` says; `sliding_window` and `kv_scales` (an fp8 pool's
    (k_scale, v_scale): kernels_pallas/reference.py) are the layer's, static."""
    backend, decode_only, max_num_prefills = plan.backend, plan.decode_only, plan.max_num_prefills
    k_scale, v_scale = kv_scales
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}; resolve it with resolve_backend")
    if backend == "cpp":
        return ragged_paged_attention_cpu(q, k_pages, v_pages, metadata, sm_scale, sliding_window, k_scale=k_scale,
                                          v_scale=v_scale)
    if backend == "xla":
        if decode_only:
            return paged_decode_attention_reference(
                q, k_pages, v_pages, metadata.seq_lens, metadata.block_tables, sm_scale, sliding_window=sliding_window,
                k_scale=k_scale, v_scale=v_scale,
            )
        # Query tiles share each gathered page: a 512-token prefill's attention ran
        # 120 -> 11 ms per layer on XLA:CPU against one query per tile, a mixed batch 70 -> 22 ms.
        if max_num_prefills is not None:
            return mixed_paged_attention_reference(
                q, k_pages, v_pages, metadata, sm_scale, block_q=XLA_MIXED_BLOCK_Q, max_prefill_reqs=max_num_prefills,
                sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
            )
        block_q = xla_mixed_block_q(q.shape[0], metadata.seq_lens.shape[0])
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, metadata, sm_scale, block_q=block_q, sliding_window=sliding_window, k_scale=k_scale,
            v_scale=v_scale,
        )
    interpret = backend == "pallas_interpret"
    if decode_only:
        return paged_decode_attention(
            q, k_pages, v_pages, metadata.seq_lens, metadata.block_tables, sm_scale, interpret=interpret,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
        )
    return ragged_paged_attention(
        q, k_pages, v_pages, metadata, sm_scale, interpret=interpret, sliding_window=sliding_window, k_scale=k_scale,
        v_scale=v_scale,
    )


def write_kv_and_attend(
    q: Float[Array, "tokens q_heads dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    kv_cache: tuple[Float[Array, "kv_heads blocks block_size dim"], Float[Array, "kv_heads blocks block_size dim"]],
    metadata: AttentionMetadata,
    sm_scale: float,
    plan: AttentionPlan,
    sliding_window: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[Float[Array, "tokens q_heads dim"], tuple[Array, Array]]:
    """One layer's KV write and attention: the step's new K/V go into the pool, then every token attends.

    The C++ CPU kernel does both in one call (two XLA:CPU scatters per layer cost about 2 ms of
    a 26 ms SmolLM2 decode step); every other backend is `write_kv` then `attention`.
    `kv_scales`: the layer's (k_scale, v_scale) of an fp8 pool, static (1.0: float pools, or fp8 uncalibrated).
    """
    if plan.mesh is not None:
        # Tensor parallel: each device runs this on its own heads and pool shard (no kernel is
        # partitioned by XLA); whole query heads sit with the KV heads they read, so attention needs
        # no communication. The metadata is replicated.
        heads, pool = P(None, MODEL_AXIS, None), P(MODEL_AXIS)
        per_shard = jax.shard_map(
            functools.partial(
                write_kv_and_attend, sm_scale=sm_scale, plan=dataclasses.replace(plan, mesh=None),
                sliding_window=sliding_window, kv_scales=kv_scales,
            ),
            mesh=plan.mesh,
            in_specs=(heads, heads, heads, (pool, pool), P()),
            out_specs=(heads, (pool, pool)),
            check_vma=False,  # custom calls (the C++ kernel) carry no varying-axis types
        )
        return per_shard(q, k, v, kv_cache, metadata)
    if plan.backend == "cpp":
        out, k_pages, v_pages = write_kv_and_attend_cpu(q, k, v, *kv_cache, metadata, sm_scale, sliding_window,
                                                        k_scale=kv_scales[0], v_scale=kv_scales[1])
        return out, (k_pages, v_pages)
    k_pages, v_pages = write_kv(*kv_cache, k, v, metadata.slot_mapping, k_scale=kv_scales[0], v_scale=kv_scales[1])
    return attention(q, k_pages, v_pages, metadata, sm_scale, plan, sliding_window, kv_scales), (k_pages, v_pages)

