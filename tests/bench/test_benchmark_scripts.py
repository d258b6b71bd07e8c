"""The developers' benchmarks in benchmarks/ still run: each is started as a user starts it, in its own
process from the repository root (tests never import benchmarks/, which is not installed)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import pytest
from tiny_checkpoint import make_tiny_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=REPO, capture_output=True, text=True)


def test_kernel_benchmark_needs_a_gpu_or_dry_run(tmp_path):
    if jax.default_backend() == "cpu":
        refused = run_benchmark("kernels", "--out", str(tmp_path / "bench.json"))
        assert refused.returncode != 0 and "pass --dry-run" in refused.stderr
    out = tmp_path / "dry.json"
    done = run_benchmark("kernels", "--dry-run", "--max-seconds", "0", "--repeats", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["stopped_early"] and report["copy_gbps"] > 0 and report["tests"]["summary"] == "not run"


def test_backend_ab_runs_each_backend_every_round(tmp_path):
    _, model_dir = make_tiny_checkpoint(tmp_path, "llama")
    out = tmp_path / "ab.json"
    native = "cpp" if jax.default_backend() == "cpu" else "pallas"  # this platform's own kernel
    done = run_benchmark(
        "backend_ab", "--model", str(model_dir), "--backends", "xla", native, "--max-num-seqs", "4",
        "--max-model-len", "64", "--max-num-batched-tokens", "32", "--block-size", "8", "--num-kv-blocks", "40",
        "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--rounds", "2", "--result-json", str(out),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {b: len(v) for b, v in result["output_throughput_rounds"].items()} == {"xla": 2, native: 2}
    assert set(result["median_output_throughput"]) == {"xla", native}


def test_ab_reports_each_setting_as_the_medians_of_its_sides_runs(tmp_path):
    _, model_dir = make_tiny_checkpoint(tmp_path, "llama")
    out = tmp_path / "ab.json"
    # Both sides are this tree (folders are used as they are): the harness's bookkeeping, not a speed-up.
    done = run_benchmark(
        "ab", "--old", ".", "--new", ".", "--benchmark", "host", "--rounds", "2", "--model", str(model_dir),
        "--result-json", str(out), "--", "--num-running", "2", "4", "--max-model-lens", "64", "--delays-ms", "0",
        "--variants", "greedy", "--output-kinds", "final_only", "--prompt-len", "4", "--output-len", "6",
        "--max-num-seqs", "4", "--block-size", "8", "--num-kv-blocks", "16",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(run["round"], run["side"]) for run in runs] == [(0, "old"), (0, "new"), (1, "new"), (1, "old")]
    rows = {(row["setting"].split(" running")[0], row["metric"]): row for row in result["rows"]}
    assert set(rows) == {(n, m) for n in ("2", "4") for m in ("host_cpu_ms_per_step", "wall_ms_per_step")}
    for (num_running, metric), row in rows.items():
        key = f"{row['setting']} | {metric}"
        for side in ("old", "new"):
            values = [run["metrics"][key] for run in runs if run["side"] == side]
            assert row[side] == pytest.approx(sum(values) / 2)  # the median of two runs
        assert row["new/old"] == pytest.approx(row["new"] / row["old"])


def test_moe_matmul_times_both_expert_formulations_at_each_step_shape(tmp_path):
    out = tmp_path / "moe.json"
    done = run_benchmark("moe_matmul", "--configs", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
                         "--calls", "1", "--rounds", "1", "--result-json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [8, 16]  # a decode bucket of 8 requests, a mixed one of 16 tokens
    assert all(row["dense_over_grouped"] == row["dense_masked_ms"] / row["grouped_ms"] > 0 for row in rows)


def test_lora_delta_forms_agree_and_are_timed(tmp_path):
    """benchmarks/lora.py --delta-forms checks the engine's one-hot LoRA update against grouped matmuls over
    tokens sorted by slot (an independent formulation) before timing both; it reads only config.json."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2}))
    out = tmp_path / "forms.json"
    done = run_benchmark("lora", "--model", str(tmp_path), "--delta-forms", "--delta-tokens", "16", "--result-json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["delta_forms"]
    assert [(row["tokens"], row["form"]) for row in rows] == [
        (16, "base dot"), (16, "one-hot (lora_delta)"), (16, "ragged_dot")]
