"""The C++ paged attention as a jax function: registration with XLA and the call."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import pathlib
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kernels_cpu.build import build, compiler, library_path
from kernels_pallas.reference import AttentionMetadata

# FFI targets per pool dtype (attention only, KV write + attention); queries and output are float32.
SUFFIXES = {jnp.dtype(jnp.float32): "F32", jnp.dtype(jnp.float16): "F16", jnp.dtype(jnp.bfloat16): "BF16"}
KERNELS = ("CbjaxPagedAttention", "CbjaxWriteKvAttention")


_lock = threading.Lock()  # held while the kernel is built and registered
# Set while a caller traces steps without waiting for the build (registration_deferred): the
# build hash their FFI target names carry.
_deferred_hash: contextvars.ContextVar[str | None] = contextvars.ContextVar("cbjax_kernel_deferred_hash", default=None)


@functools.lru_cache(maxsize=None)
def _register_once() -> str:
    """Register every kernel under a name that carries the library's build hash; that hash.

    Compiled steps find the target by name, so a step in the persistent compilation cache
    names the exact kernel build it was compiled with: a rebuilt kernel changes the steps'
    HLO, hence their cache key, and is never paired with a stale executable.
    """
    path = build()
    build_hash = _hash_of(path)
    library = ctypes.cdll.LoadLibrary(str(path))
    for kernel in KERNELS:
        for suffix in SUFFIXES.values():
            symbol = kernel + suffix
            target = f"{symbol}_{build_hash}"
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return build_hash


def build_hash() -> str:
    """The hash the FFI targets of this machine's build are named with, known before the build exists."""
    return _hash_of(library_path(compiler()))


def _hash_of(library: pathlib.Path) -> str:
    return library.stem.rsplit("_", 1)[-1]  # build.library_path names the library ..._<hash>.so


def _target_suffix(k_pages: Array, v_pages: Array) -> str:
    """The FFI targets' suffix for these pools' dtype and this build, once the pools are checked and the kernel
    registered (or, under registration_deferred, named only)."""
    if k_pages.dtype not in SUFFIXES or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"the CPU attention kernel takes float32, float16 or bfloat16 pools, got K {k_pages.dtype} and "
            f"V {v_pages.dtype}; use kv_cache_dtype='float32' or 'float16', or attention_backend='xla'"
        )
    return f"{SUFFIXES[k_pages.dtype]}_{_deferred_hash.get() or _register()}"


def _register() -> str:
    """Build and register the kernel once per process (buckets are traced from several threads); its build hash."""
    with _lock:
        return _register_once()


@contextlib.contextmanager
def registration_deferred() -> Iterator[None]:
    """Trace (and lower) calls to the kernel without waiting for its build: the FFI targets are
    named from the build's hash alone. Whoever compiles what was traced must first call
    kernel_problem(), which waits for the build and registers the targets (XLA looks them up then).

    The engine traces its steps this way while the compiler still runs (register_in_background):
    on a machine without a build, tracing and building overlap instead of following each other.
    """
    token = _deferred_hash.set(build_hash())
    try:
        yield
    finally:
        _deferred_hash.reset(token)


def register_in_background() -> threading.Thread:
    """Build (where this machine has no build yet) and register the kernel on a thread: the
    compiler, a process of its own, runs while the engine loads the weights and traces its steps.
    kernel_problem() waits for it and says how it went."""
    started = threading.Event()

    def register() -> None:
        with _lock:
            started.set()
            try:
                _register_once()
            except Exception:  # noqa: BLE001 - kernel_problem() builds again and reports it
                pass

    thread = threading.Thread(target=register, name="cbjax-kernel-build", daemon=True)
    thread.start()
    started.wait()  # the lock is held: kernel_problem(wait=False) sees the build under way
    return thread


def kernel_registered() -> bool:
    """Whether this process has built and registered the kernel (never waits)."""
    return _register_once.cache_info().currsize > 0


def kernel_problem(wait: bool = True) -> str | None:
    """Why the kernel can't run here (no compiler, a failed build), or None once it is registered.

    With wait=False while register_in_background's build is under way: None if a compiler is
    there, without waiting (the build's own outcome is known to the next caller that waits).
    """
    try:
        if not wait and _lock.locked():
            compiler()
            return None
        _register()
    except Exception as error:  # noqa: BLE001 - any failure means "serve with the jnp path", with the reason
        return f"{type(error).__name__}: {error}"
    return None


def _request_metadata(metadata: AttentionMetadata) -> tuple[Array, Array, Array]:
    """The kernel's last three inputs: query_start_loc, seq_lens, block_tables (int32)."""
    return tuple(x.astype(jnp.int32) for x in (metadata.query_start_loc, metadata.seq_lens, metadata.block_tables))


def write_kv_and_attend_cpu(
    q: Float[Array, "tokens q_heads dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
) -> tuple[Float[Array, "tokens q_heads dim"], Float[Array, "kv_heads blocks block_size dim"], Float[Array, "kv_heads blocks block_size dim"]]:
    """`write_kv` then `ragged_paged_attention_reference`, in one C++ call (CPU only).

    The pools go in and come out aliased, so under a donating jit the write is in place. Decode
    steps are the case of one token per request; there is no separate decode entry.
    """
    suffix = _target_suffix(k_pages, v_pages)
    call = jax.ffi.ffi_call(
        "CbjaxWriteKvAttention" + suffix,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), k_pages, v_pages),
        input_output_aliases={4: 1, 5: 2},
    )
    out, k_pages, v_pages = call(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        metadata.slot_mapping.astype(jnp.int32),
        k_pages,
        v_pages,
        *_request_metadata(metadata),
        sm_scale=np.float32(sm_scale),
    )
    return out.astype(q.dtype), k_pages, v_pages


def ragged_paged_attention_cpu(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
) -> Float[Array, "tokens q_heads dim"]:
    """`ragged_paged_attention_reference`'s result from the C++ kernel; the pools are only read."""
    suffix = _target_suffix(k_pages, v_pages)
    call = jax.ffi.ffi_call("CbjaxPagedAttention" + suffix, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, *_request_metadata(metadata), sm_scale=np.float32(sm_scale))
    return out.astype(q.dtype)
