"""The soak of issue 35, short: `python -m benchmarks.soak_server` (started as a user starts it) sends
300 requests at twice the engine's capacity to `cbjax serve` with its engine core in its own process:
streamed and not, n up to 4, stop strings, clients leaving mid-stream, aborts, invalid requests. No
request may fail, lose its final chunk or get another's text, and afterwards the server is idle and
answers, within the RSS bound."""

from __future__ import annotations

import json
import subprocess
import sys

from server_process import REPO
from tiny_checkpoint import make_tiny_checkpoint

NUM_REQUESTS = 300


def test_soak_under_overload_loses_and_mixes_nothing(tmp_path):
    _, model_dir = make_tiny_checkpoint(tmp_path, "llama")
    result_path = tmp_path / "soak.json"
    done = subprocess.run([
        sys.executable, "-m", "benchmarks.soak_server", "--model", str(model_dir), "--num-requests", str(NUM_REQUESTS),
        "--engine-process", "on", "--max-num-seqs", "8", "--max-model-len", "64", "--max-tokens", "12",
        "--deadline-s", "120", "--log-dir", str(tmp_path), "--result-json", str(result_path),
        "--serve-flags", "--dtype float32 --block-size 8 --num-kv-blocks 64 --max-num-batched-tokens 32",
    ], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result_path.exists(), done.stderr[-3000:]
    (run,) = json.loads(result_path.read_text())["runs"]
    assert run["failures"] == [], (tmp_path / "soak-server-process.log").read_text()[-3000:]
    assert done.returncode == 0
    assert run["requests_sent"] == NUM_REQUESTS
    assert set(run["requests_by_kind"]) == {"greedy", "sampled", "chat", "disconnect", "abort", "invalid"}
    statuses = run["responses_by_status"]
    assert statuses.get("200", 0) > NUM_REQUESTS // 2 and statuses.get("disconnected", 0) > 0
    assert statuses.get("400", 0) > 0 and "unanswered" not in statuses and "connection error" not in statuses
    assert run["gauges_after"] == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                   "vllm:kv_cache_usage_perc": 0}
    assert run["health_after"] == 200 and run["rss_mib"]["peak"] <= run["rss_mib"]["bound"]
