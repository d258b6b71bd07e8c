#!/usr/bin/env bash
# Two checkouts of cbjax side by side on one throughput workload, alternated ROUNDS times, so a
# change can be told from machine noise. Both run with this repo's .venv, each with its own code
# first on PYTHONPATH, the compilation cache off (each compiles its own steps).
#   bash benchmarks/ab_checkouts.sh OLD_DIR NEW_DIR [ROUNDS] [-- extra `cbjax bench throughput` args for NEW]
# Example (long prompts): OLD_DIR a `git worktree add --detach` of an older commit, NEW_DIR this repo.
# AB_ARGS replaces the workload below for both sides; VENV picks another virtualenv.
set -euo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 )); [[ ${1:-} == -- ]] && shift
venv=$(realpath "${VENV:-$(dirname "$0")/../.venv}")
args=(--model checkpoints/smollm2-135m-instruct --num-prompts 32 --input-len 512 --output-len 64 --range-ratio 0.5
      --max-num-seqs 16 --max-model-len 1024 --max-num-batched-tokens 256 --kv-cache-memory-bytes 268435456 --repeats 1)
[[ -n ${AB_ARGS:-} ]] && read -ra args <<< "$AB_ARGS"
mkdir -p bench_results
for round in $(seq "$rounds"); do
  for side in old new; do
    dir=$old; extra=(); [[ $side == new ]] && dir=$new && extra=("$@")
    out=$(realpath bench_results)/ab_${side}_${round}.json
    (cd "$dir" && PYTHONPATH=$dir CBJAX_DISABLE_COMPILE_CACHE=1 "$venv/bin/python" -m cbjax bench throughput \
      "${args[@]}" "${extra[@]}" --result-json "$out" > /dev/null 2>&1)
    m=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['medians']['continuous']; print(f\"{m['output_throughput']:.1f} out tok/s, {m['num_steps']} steps, {m['num_preemptions']} preemptions\")" "$out")
    echo "$side round $round: $m ($(uptime | sed 's/.*load average/load/'))"
  done
done
