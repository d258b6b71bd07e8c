"""The persistent compilation cache: on by default, and a new process with the same options compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from test_kernel_lowering import metadata as abstract_metadata
from tiny_checkpoint import make_tiny_checkpoint
from xla_flags import with_host_devices

from cbjax.worker.compilation.compile_cache import DISABLE_ENV, compile_cache_folder
from kernels_cpu import build as kernel_build
from kernels_cpu.attention import write_kv_and_attend_cpu

REPO = Path(__file__).resolve().parents[2]

# One engine in a fresh process: its XLA compiles (as JAX's own cache events count them) and its greedy tokens.
CHILD = """
import json, logging, sys
import jax
step_programs = []  # every jitted step JAX lowers (it logs each lowering at DEBUG, with the function's name)
class CountSteps(logging.Handler):
    def emit(self, record):
        if record.msg.startswith("Compiling ") and record.args[0].startswith("jit(step"):  # jit(step_<its cache key>)
            step_programs.append(record.args[0])
pxla_log = logging.getLogger("jax._src.interpreters.pxla")
pxla_log.setLevel(logging.DEBUG)
pxla_log.addHandler(CountSteps())
events = {}
jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
from cbjax import LLM, SamplingParams
# 4 buckets: decode 8 and 16 rows, mixed 16 and 32 tokens of 16 rows.
llm = LLM(sys.argv[1], max_num_seqs=16, max_model_len=64, max_num_batched_tokens=32, block_size=8, seed=int(sys.argv[2]))
out = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
requests = events.get("/jax/compilation_cache/compile_requests_use_cache", 0)
print(json.dumps({"requests": requests, "compiles": requests - events.get("/jax/compilation_cache/cache_hits", 0),
                  "tokens": out[0].outputs[0].token_ids, "backend": llm.get_stats()["attention_backend"],
                  "step_programs": len(step_programs), "platform": jax.devices()[0].platform}))
"""


def run_engine_process(checkpoint: Path, cache: Path, seed: int = 0) -> dict:
    # Four host devices, as on a multi-GPU host: the engine runs on one of them.
    env = os.environ | {"CBJAX_CACHE_DIR": str(cache), "XLA_FLAGS": with_host_devices(4),
                        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop(DISABLE_ENV, None)
    result = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), str(seed)], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_new_process_compiles_only_the_steps_no_start_stored(tmp_path):
    """The first engine compiles every step into the default cache. Another seed changes no step
    program but the step cache's key (as a code change would): that engine compiles its steps afresh
    instead of taking JAX's cached ones, which could not be stored, so the next start with the same
    options loads them whole, without even tracing them, and compiles nothing. The processes see four
    host devices: a stored one-device step must load onto the engine's device alone (loaded onto
    every device, it refused its arguments)."""
    _, checkpoint = make_tiny_checkpoint(tmp_path)
    first = run_engine_process(checkpoint, tmp_path / "cache", seed=0)
    assert first["compiles"] >= 3, "the first process should compile every step bucket into the default cache"
    assert list((tmp_path / "cache" / "xla").iterdir()), "the default cache lives under CBJAX_CACHE_DIR/xla"
    # 16 sequences, 32 tokens: mixed buckets of 16 and 32 tokens; decode buckets of 2, 4, 8 and 16 requests with
    # the C++ CPU kernels (buckets.CPU_MIN_DECODE_REQS), 8 and 16 elsewhere. The C++ kernel runs decode steps as
    # mixed ones: decode 16 rows and mixed 16 tokens are one program (5 in all; elsewhere 4).
    # On an accelerator the pool is sized from memory: a 2-block probe compiles the largest decode
    # and mixed steps first (its scratch is stored with the steps, so the warm start below skips it).
    probe = 0 if first["platform"] == "cpu" else 2
    assert first["step_programs"] == (5 if first["backend"] == "cpp" else 4) + probe
    other = run_engine_process(checkpoint, tmp_path / "cache", seed=1)
    assert other["step_programs"] == first["step_programs"] and other["compiles"] >= other["step_programs"]
    again = run_engine_process(checkpoint, tmp_path / "cache", seed=1)
    assert again["step_programs"] == 0 and again["compiles"] == 0
    assert first["tokens"] == other["tokens"] == again["tokens"]  # greedy: the seed changes nothing


def test_cache_is_on_by_default_and_off_by_none_or_the_env_flag(tmp_path, monkeypatch):
    device = jax.devices()[0]
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    auto = compile_cache_folder("auto", device)
    assert auto.parent == tmp_path / "xla"
    assert compile_cache_folder(str(tmp_path / "mine"), device) == tmp_path / "mine"
    assert compile_cache_folder(None, device) is None
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert compile_cache_folder("auto", device) is None


def test_default_folder_changes_with_the_cpu_features(tmp_path, monkeypatch):
    """JAX's key does not cover the CPU's instruction set; the folder must, for caches shared between machines."""
    device = jax.devices()[0]
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    here = compile_cache_folder("auto", device)
    monkeypatch.setattr("cbjax.worker.compilation.compile_cache.cpu_features", lambda: "flags : fpu sse2")
    assert compile_cache_folder("auto", device) != here


def test_compiled_steps_name_the_kernel_build_they_call():
    """A rebuilt kernel changes the steps' HLO (so their cache key): its build hash is in the FFI target name."""
    build_hash = kernel_build.library_path(kernel_build.compiler()).stem.rsplit("_", 1)[-1]
    pool = jax.ShapeDtypeStruct((1, 4, 8, 16), jnp.float32)
    new = jax.ShapeDtypeStruct((2, 1, 16), jnp.float32)
    hlo = jax.jit(lambda *a: write_kv_and_attend_cpu(*a, sm_scale=0.25)).lower(
        new, new, new, pool, pool, abstract_metadata(num_tokens=2, num_reqs=2, max_blocks=2)
    ).as_text()
    assert f"CbjaxWriteKvAttentionF32_{build_hash}" in hlo
