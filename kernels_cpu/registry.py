"""Building the C++ kernels' library and registering its FFI targets with XLA, once per process.

Every target is registered under a name that carries the library's build hash (`target`), so a
compiled step names the exact build it was compiled with. The engine may trace its steps while
the library still builds (`register_in_background`, `registration_deferred`); whoever compiles
them first calls `kernel_problem()`, which waits for the build and says whether it worked.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import pathlib
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from kernels_cpu.build import build, compiler, library_path

logger = logging.getLogger(__name__)

# The attention targets, one per pool dtype (attention only; KV write + attention).
POOL_SUFFIXES = {
    jnp.dtype(jnp.float32): "F32", jnp.dtype(jnp.float16): "F16", jnp.dtype(jnp.bfloat16): "BF16",
    jnp.dtype(jnp.float8_e4m3fn): "F8E4M3",
}
ATTENTION_KERNELS = ("CbjaxPagedAttention", "CbjaxWriteKvAttention")
# Every symbol the library exports as an XLA FFI handler.
SYMBOLS = (
    *(kernel + suffix for kernel in ATTENTION_KERNELS for suffix in POOL_SUFFIXES.values()),
    "CbjaxPackedMatmulF32",
    "CbjaxPackedMatmulBF16",
    "CbjaxPackedMatmulI8",
    "CbjaxPackedMatmulI8Mins",
    "CbjaxPackedMatmulF8",
    "CbjaxPackedMatmulQ4",
    "CbjaxPackedMatmulQ4Grid",
)

_lock = threading.Lock()  # held while the library is built and registered
# Set while a caller traces steps without waiting for the build (registration_deferred): the
# build hash their FFI target names carry.
_deferred_hash: contextvars.ContextVar[str | None] = contextvars.ContextVar("cbjax_kernel_deferred_hash", default=None)


@functools.lru_cache(maxsize=None)
def _register_once() -> str:
    """Register every symbol under a name that carries the library's build hash; that hash.

    Compiled steps find the target by name, so a step in the persistent compilation cache
    names the exact kernel build it was compiled with: a rebuilt kernel changes the steps'
    HLO, hence their cache key, and is never paired with a stale executable.
    """
    path = build()
    build_hash = _hash_of(path)
    library = ctypes.cdll.LoadLibrary(str(path))
    for symbol in SYMBOLS:
        jax.ffi.register_ffi_target(f"{symbol}_{build_hash}", jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    logger.info("cbjax CPU kernels %s: bfloat16 weights multiply by %s", path.name, BF16_PATHS[_bf16_path(library)])
    return build_hash


# What the bf16 matmul's path names (packed_matmul.cc's CbjaxBf16MatmulPath), for the start-up log.
BF16_PATHS = {
    "amx": "AMX tiles (tdpbf16ps)", "avx512-bf16": "AVX512-BF16 (vdpbf16ps)",
    "avx512": "AVX-512, pairs widened to float32 (no bf16 dot instruction)", "portable": "plain loops (no AVX-512)",
}


def _bf16_path(library: ctypes.CDLL) -> str:
    path = library.CbjaxBf16MatmulPath
    path.restype = ctypes.c_char_p
    return path().decode()


def bf16_matmul_path() -> str:
    """Which path this machine's build takes for bfloat16 weights: "amx", "avx512-bf16", "avx512" or
    "portable" (chosen by the CPU's flags when the library is built with -march=native; AMX also needs
    Linux to grant the process its tile state, and CBJAX_CPU_AMX=0 turns it off)."""
    _register()
    return _bf16_path(ctypes.cdll.LoadLibrary(str(library_path(compiler()))))


def build_hash() -> str:
    """The hash the FFI targets of this machine's build are named with, known before the build exists."""
    return _hash_of(library_path(compiler()))


def _hash_of(library: pathlib.Path) -> str:
    return library.stem.rsplit("_", 1)[-1]  # build.library_path names the library ..._<hash>.so


def target(symbol: str) -> str:
    """The FFI target name of `symbol` in this machine's build: registered first if need be (or,
    under registration_deferred, named only)."""
    return f"{symbol}_{_deferred_hash.get() or _register()}"


def _register() -> str:
    """Build and register the library once per process (buckets are traced from several threads); its build hash."""
    with _lock:
        return _register_once()


@contextlib.contextmanager
def registration_deferred() -> Iterator[None]:
    """Trace (and lower) calls to the kernels without waiting for their build: the FFI targets are
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
    """Build (where this machine has no build yet) and register the kernels on a thread: the
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
    """Whether this process has built and registered the kernels (never waits)."""
    return _register_once.cache_info().currsize > 0


def kernel_problem(wait: bool = True) -> str | None:
    """Why the kernels can't run here (no compiler, a failed build), or None once they are registered.

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
