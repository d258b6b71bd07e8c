"""Shared test setup: the `gpu` marker skips cleanly on machines without a CUDA GPU; one XLA compilation cache
for the session in a temporary folder, never the user's compilation or weights cache."""

import os
import shutil
import subprocess
import sys
import tempfile

# One XLA compilation cache for the whole session, in a temporary folder: its workers and their child
# processes (set before JAX is imported, which reads it from the environment). Many files build the same
# tiny models with the same options, whose step programs then compile once per session instead of once
# per file. Tracing still runs, so a test that patches the code gets its own program; JAX's compile event
# (engine_helpers.CompileCounter) fires on a cache hit too. JAX writes entries without a lock unless the cache
# has a size limit, and with one it lists the whole folder on every write (minutes over this suite): a worker
# reading an entry that another is writing that very moment gets a warning and compiles the step itself.
_SESSION_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbjax-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

# The tests build many throwaway tiny models: keep their steps out of the user's compilation cache
# (tests/worker/test_compile_cache.py turns it on in its own processes).
os.environ.setdefault("CBJAX_DISABLE_COMPILE_CACHE", "1")
# Nor their weights in the user's weights cache (tests/checkpoint/test_weights_cache.py turns it on in a temp folder).
os.environ.setdefault("CBJAX_DISABLE_WEIGHTS_CACHE", "1")
# Tiny models' programs take microseconds to run and seconds to compile: LLVM level 0 compiles them with a
# quarter to a third less CPU (tests/engine/test_engine.py 152 -> 113 s user, test_reference_attention.py
# 38 -> 25 s), the same numbers. Set before JAX starts its backend; child processes inherit it (xla_flags.py).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag` (one it does not know aborts the process that starts a backend)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True, timeout=300,
                           env=os.environ | {"XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}, check=False)
    return probe.returncode == 0


# XLA:CPU's MLIR fusion emitters spend about half of a tiny engine's compile time; its older elemental
# emitters compile the same fusions in half that (the tiny llama engine of tests/engine/test_engine.py builds
# in 2.2 s instead of 4.3 s, with the same tokens). The engine itself keeps XLA's default. Probed once, in
# pytest's first process, whose workers inherit the answer: a later jaxlib may have dropped the flag.
_FAST_FUSIONS = "--xla_cpu_use_fusion_emitters=false"
_PROBED = "CBJAX_TESTS_FUSION_FLAG_PROBED"
if _PROBED not in os.environ and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ[_PROBED] = "1"
    if _xla_accepts(_FAST_FUSIONS):
        os.environ["XLA_FLAGS"] += f" {_FAST_FUSIONS}"


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


if has_gpu():
    # XLA on NVIDIA GPUs gives float32 dots TF32 inputs by default; the tests' float32 references
    # (jnp attention, numpy, transformers on CPU) are exact, and so is the engine at float32
    # (cbjax/worker/model_runner.py: matmul_precision), so the test code's own dots must be too.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU host; see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _SESSION_XLA_CACHE is not None:  # the process that made it (pytest's controller, or the only process)
        shutil.rmtree(_SESSION_XLA_CACHE, ignore_errors=True)
