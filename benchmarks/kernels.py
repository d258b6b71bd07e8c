"""GPU benchmark of the paged-attention kernels: `PYTHONPATH=. python -m benchmarks.kernels --out kernels.json`.

One call, a few minutes on an H100/H200:
  1. runs the gpu-marked kernel tests (pytest -m gpu, in a subprocess);
  2. measures a device-to-device copy (x + 1 over 1 GiB: read + write bytes / time);
  3. decode sweep at Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128,
     block size 16, bf16), batch x context: the cbjax decode kernel, the cbjax
     ragged kernel on the same decode batch, JAX's own
     `jax.experimental.pallas.ops.gpu.paged_attention` and the XLA reference,
     each as K/V bytes read / time;
  4. prefill and mixed batches through the ragged kernel against the XLA reference.
Times are medians over repeats of `--inner` back-to-back calls ended by
block_until_ready, after a warm-up. The JSON is rewritten after every row, so a
run cut short still leaves what it measured; a short table goes to stdout.

`--dry-run` does all of it on CPU with interpreted kernels at tiny shapes (no
tests unless --tests), to check the script itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged_attention

from kernels_pallas.paged_attention import paged_decode_attention
from kernels_pallas.ragged_attention import ragged_paged_attention
from kernels_pallas.reference import (
    AttentionMetadata,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    # Ragged cases: name -> (q_len, seq_len) per request.
    ragged: dict[str, list[tuple[int, int]]]


LLAMA3_8B = Shapes(
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    batches=(1, 16, 64, 256),
    contexts=(512, 2048, 8192),
    ragged={
        "prefill 4x512": [(512, 512)] * 4,
        "prefill 1x4096": [(4096, 4096)],
        "chunk 2x512 over 4096 cached": [(512, 4608)] * 2,
        "chunk 512 + 64 decodes at 2048": [(512, 512)] + [(1, 2048)] * 64,
    },
)
TINY_CPU = Shapes(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    block_size=16,
    batches=(1, 3),
    contexts=(32, 80),
    ragged={"prefill 2x20": [(20, 20)] * 2, "chunk 5 + 2 decodes": [(5, 40), (1, 17), (1, 64)]},
)


def run_gpu_tests(timeout_s: int) -> dict:
    """The gpu-marked kernel tests, in a subprocess so a crash there can't take the benchmark down."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py"]
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "returncode": None, "summary": f"timed out after {timeout_s}s"}
    lines = done.stdout.strip().splitlines()
    failures = [line for line in lines if line.startswith("FAILED")]
    return {"command": " ".join(cmd), "returncode": done.returncode, "summary": lines[-1] if lines else done.stderr[-500:],
            "failed": failures}


def median_seconds(fn: Callable[[], jax.Array], repeats: int, inner: int) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls, after a warm-up."""
    fn().block_until_ready()
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
        out.block_until_ready()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, repeats: int, inner: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and the bytes written."""
    x = jnp.zeros((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 1)
    return 2 * num_bytes / median_seconds(lambda: copy(x), repeats, inner) / 1e9


def paged_batch(key: jax.Array, shapes: Shapes, requests: list[tuple[int, int]], dtype) -> tuple:
    """q, pools and metadata for requests given as (q_len, seq_len), each on its own shuffled pages."""
    bs = shapes.block_size
    pages_per_req = [-(-seq_len // bs) for _, seq_len in requests]
    max_blocks = max(pages_per_req)
    num_blocks = 1 + sum(pages_per_req)
    k_key, v_key, q_key, perm_key = jax.random.split(key, 4)
    pool_shape = (shapes.num_kv_heads, num_blocks, bs, shapes.head_dim)
    k_pages = jax.random.normal(k_key, pool_shape, dtype)
    v_pages = jax.random.normal(v_key, pool_shape, dtype)
    blocks = np.asarray(jax.random.permutation(perm_key, np.arange(1, num_blocks)))
    block_tables = np.zeros((len(requests), max_blocks), np.int32)
    used = 0
    for req, pages in enumerate(pages_per_req):
        block_tables[req, :pages] = blocks[used : used + pages]
        used += pages
    q_lens = [q_len for q_len, _ in requests]
    q = jax.random.normal(q_key, (sum(q_lens), shapes.num_q_heads, shapes.head_dim), dtype)
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((sum(q_lens),), jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        seq_lens=jnp.asarray([seq_len for _, seq_len in requests], jnp.int32),
        block_tables=jnp.asarray(block_tables),
    )
    return q, k_pages, v_pages, metadata


def kv_bytes(shapes: Shapes, requests: list[tuple[int, int]], itemsize: int) -> int:
    """K and V bytes a request batch must read at least: every cached token once per KV head."""
    return 2 * sum(seq_len for _, seq_len in requests) * shapes.num_kv_heads * shapes.head_dim * itemsize


def attention_flops(shapes: Shapes, requests: list[tuple[int, int]]) -> int:
    """Multiply-adds of QK^T and PV (x2 flops) over the keys each new token sees (causal)."""
    visible = sum(seq_len * q_len - q_len * (q_len - 1) // 2 for q_len, seq_len in requests)
    return 4 * visible * shapes.num_q_heads * shapes.head_dim


def measure(impls: dict[str, Callable[[], jax.Array]], reference: str, bytes_read: int, flops: int,
            repeats: int, inner: int) -> dict:
    """Time each implementation; record GB/s, TFLOP/s and its max deviation from `reference`."""
    expected = np.asarray(impls[reference](), np.float32)
    results = {}
    for name, fn in impls.items():
        try:
            deviation = float(np.abs(np.asarray(fn(), np.float32) - expected).max())
            seconds = median_seconds(fn, repeats, inner)
        except Exception as e:  # noqa: BLE001 -- one failing implementation must not end the run
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
            continue
        results[name] = {"us": seconds * 1e6, "gbps": bytes_read / seconds / 1e9, "tflops": flops / seconds / 1e12,
                         "max_abs_diff": deviation}
    return results


def decode_impls(shapes: Shapes, q, k_pages, v_pages, metadata: AttentionMetadata, sm_scale: float,
                 interpret: bool) -> dict[str, Callable[[], jax.Array]]:
    decode = jax.jit(lambda q, k, v, md: paged_decode_attention(
        q, k, v, md.seq_lens, md.block_tables, sm_scale, interpret=interpret))
    ragged = jax.jit(lambda q, k, v, md: ragged_paged_attention(q, k, v, md, sm_scale, interpret=interpret))
    reference = jax.jit(lambda q, k, v, md: paged_decode_attention_reference(
        q, k, v, md.seq_lens, md.block_tables, sm_scale))
    # JAX's kernel has no sm_scale, and its partitions must divide the table: scale q, pad the table to a
    # power of two, and use its defaults (16 splits, 8 pages per step) where the table is long enough.
    pages = metadata.block_tables.shape[1]
    padded_pages = pl.next_power_of_2(pages)
    k_splits = min(16, padded_pages)
    tables = jnp.pad(metadata.block_tables, ((0, 0), (0, padded_pages - pages)))
    theirs = jax.jit(lambda q, k, v, md, tables: jax_paged_attention.paged_attention(
        q * jnp.asarray(sm_scale, q.dtype), k, v, tables, md.seq_lens, k_splits=k_splits,
        pages_per_compute_block=min(8, padded_pages // k_splits), interpret=interpret))
    return {
        "cbjax_decode": lambda: decode(q, k_pages, v_pages, metadata),
        "cbjax_ragged": lambda: ragged(q, k_pages, v_pages, metadata),
        "jax_paged_attention": lambda: theirs(q, k_pages, v_pages, metadata, tables),
        "xla_reference": lambda: reference(q, k_pages, v_pages, metadata),
    }


def ragged_impls(q, k_pages, v_pages, metadata: AttentionMetadata, sm_scale: float,
                 interpret: bool) -> dict[str, Callable[[], jax.Array]]:
    ragged = jax.jit(lambda q, k, v, md: ragged_paged_attention(q, k, v, md, sm_scale, interpret=interpret))
    reference = jax.jit(lambda q, k, v, md: ragged_paged_attention_reference(q, k, v, md, sm_scale))
    return {
        "cbjax_ragged": lambda: ragged(q, k_pages, v_pages, metadata),
        "xla_reference": lambda: reference(q, k_pages, v_pages, metadata),
    }


def print_table(report: dict) -> None:
    print(f"\ncopy: {report['copy_gbps']:.0f} GB/s (read + write)   tests: {report['tests'].get('summary')}")
    for section in ("decode", "ragged"):
        rows = report[section]
        if not rows:
            continue
        names = list(rows[0]["results"])
        print(f"\n{section}: GB/s of K/V read (% of copy bandwidth); prefill rows also TFLOP/s")
        print(f"{'case':<34}" + "".join(f"{name:>22}" for name in names))
        for row in rows:
            cells = []
            for name in names:
                r = row["results"][name]
                if "error" in r:
                    cells.append(f"{'error':>22}")
                    continue
                pct = 100 * r["gbps"] / report["copy_gbps"]
                extra = f" {r['tflops']:.0f}TF" if section == "ragged" else ""
                cells.append(f"{r['gbps']:>9.0f} ({pct:3.0f}%){extra:>6}")
            print(f"{row['case']:<34}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("kernels_bench.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreted kernels, tiny shapes")
    parser.add_argument("--tests", action=argparse.BooleanOptionalAction, default=None,
                        help="run the gpu-marked tests first (default: yes, except with --dry-run)")
    parser.add_argument("--tests-timeout", type=int, default=240, help="seconds for the test subprocess")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (median taken)")
    parser.add_argument("--inner", type=int, default=None, help="back-to-back calls per timed repeat")
    parser.add_argument("--max-seconds", type=float, default=420.0,
                        help="stop starting new cases after this long (the JSON keeps what was measured)")
    args = parser.parse_args(argv)

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not on_gpu and not args.dry_run:
        parser.error(f"no GPU visible to jax (devices: {jax.devices()}); run on a GPU host or pass --dry-run")
    shapes, dtype, interpret = (TINY_CPU, jnp.float32, True) if args.dry_run else (LLAMA3_8B, jnp.bfloat16, False)
    repeats = args.repeats or (2 if args.dry_run else 10)
    inner = args.inner or (1 if args.dry_run else 10)
    copy_bytes = (1 << 20) if args.dry_run else (1 << 30)
    sm_scale = shapes.head_dim**-0.5
    itemsize = jnp.dtype(dtype).itemsize
    run_tests = args.tests if args.tests is not None else not args.dry_run
    started = time.monotonic()

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "shapes": dataclasses.asdict(shapes),
        "dtype": jnp.dtype(dtype).name,
        "repeats": repeats,
        "inner": inner,
        "tests": run_gpu_tests(args.tests_timeout) if run_tests else {"summary": "not run"},
        "copy_gbps": copy_bandwidth(copy_bytes, repeats, inner),
        "decode": [],
        "ragged": [],
        "stopped_early": False,
    }

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1))

    save()
    cases = [("decode", f"decode b={b} ctx={c}", [(1, c)] * b) for c in shapes.contexts for b in shapes.batches]
    cases += [("ragged", name, requests) for name, requests in shapes.ragged.items()]
    for key_index, (section, name, requests) in enumerate(cases):
        if time.monotonic() - started > args.max_seconds:
            report["stopped_early"] = True
            break
        q, k_pages, v_pages, metadata = paged_batch(jax.random.key(key_index), shapes, requests, dtype)
        if section == "decode":
            impls = decode_impls(shapes, q, k_pages, v_pages, metadata, sm_scale, interpret)
        else:
            impls = ragged_impls(q, k_pages, v_pages, metadata, sm_scale, interpret)
        results = measure(impls, "xla_reference", kv_bytes(shapes, requests, itemsize),
                          attention_flops(shapes, requests), repeats, inner)
        report[section].append({"case": name, "requests": len(requests), "tokens": int(q.shape[0]), "results": results})
        save()
        print(f"[{time.monotonic() - started:6.1f}s] {name}", flush=True)
        del q, k_pages, v_pages, metadata, impls

    save()
    print_table(report)
    print(f"\nwrote {args.out}")
    return 0 if report["tests"].get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
