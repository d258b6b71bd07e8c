"""Join scripts/bench_{cbjax,vllm}_serve.sh's per-rate results into one JSON and a Markdown table:
per request rate, both servers' completed requests, output tok/s, TTFT median/p99, ITL median, and
cbjax over vLLM; then where each server's mean TTFT went (front end, queue, prefill: from its /metrics
scraped before and after the rate, cbjax.bench.serve_breakdown). Run by
scripts/bench_serve_side_by_side.sh, which passes the load averages it read.

    python benchmarks/serve_side_by_side.py --rates 1 2 4 --loadavg "cbjax: 5.1 ..." --out bench_results/serve_side_by_side.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cbjax.bench.serve_breakdown import ttft_breakdown

METRICS = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "duration")
SERVERS = ("cbjax", "vllm")


def row(rate: str, results: Path) -> dict:
    sides = {name: json.loads((results / f"{name}_serve_rate{rate}.json").read_text()) for name in SERVERS}
    joined = {"request_rate": float(rate)} | {name: {m: sides[name][m] for m in METRICS} for name in SERVERS}
    # Higher is better for throughput, lower for latencies; the ratio is always cbjax / vLLM.
    joined["cbjax_over_vllm"] = {m: sides["cbjax"][m] / sides["vllm"][m] for m in METRICS[1:5] if sides["vllm"][m]}
    for name in SERVERS:
        scrapes = [results / f"{name}_serve_rate{rate}.metrics_{when}" for when in ("before", "after")]
        if all(path.exists() for path in scrapes):
            texts = [path.read_text() for path in scrapes]
            joined[name]["ttft_breakdown_ms"] = ttft_breakdown(*texts, sides[name]["mean_ttft_ms"])
    return joined


def table(rows: list[dict]) -> str:
    lines = ["| rate (req/s) | server | completed | out tok/s | TTFT median / p99 ms | ITL median ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for name in SERVERS:
            s = r[name]
            lines.append(f"| {r['request_rate']:g} | {name} | {s['completed']} | {s['output_throughput']:.1f} | "
                         f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['median_itl_ms']:.0f} |")
        q = r["cbjax_over_vllm"]
        lines.append(f"| {r['request_rate']:g} | cbjax / vLLM | | {q['output_throughput']:.2f}x | "
                     f"{q['median_ttft_ms']:.2f}x / {q['p99_ttft_ms']:.2f}x | {q['median_itl_ms']:.2f}x |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict]) -> str:
    lines = ["| rate (req/s) | server | mean TTFT ms (client) | front end | queue (step end, seat) | prefill | engine TTFT |",
             "|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for r in rows:
        for name in SERVERS:
            if b := r[name].get("ttft_breakdown_ms"):
                lines.append(f"| {r['request_rate']:g} | {name} | {ms(b['client_ttft'])} | {ms(b['front_end'])} | "
                             f"{ms(b['queue'])} | {ms(b['prefill'])} | {ms(b['engine_ttft'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", nargs="+", required=True)
    parser.add_argument("--results", type=Path, default=Path("bench_results"))
    parser.add_argument("--loadavg", action="append", default=[], help="'when: 1-min 5-min 15-min' lines")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [row(rate, args.results) for rate in args.rates]
    args.out.write_text(json.dumps({"loadavg": args.loadavg, "rows": rows}, indent=2))
    print("load average:", "; ".join(args.loadavg))
    print(table(rows))
    print(breakdown_table(rows))


if __name__ == "__main__":
    main()
