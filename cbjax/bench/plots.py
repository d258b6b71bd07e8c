"""PNG plots of a benchmark run (`--plot DIR`); matplotlib is optional and imported only here."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(
            "--plot needs matplotlib, which cbjax does not install by default; "
            "pip install matplotlib (or the 'bench' extra) or drop --plot"
        ) from error
    return plt


def plot_steps(out_dir: pathlib.Path, runs: Mapping[str, Mapping[str, Sequence[Any]]]) -> list[pathlib.Path]:
    """From per-step columns (recorder.step_series) of each named run: queues, KV, occupancy over time."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for name, s in runs.items():
        t = s["time_s"]
        axes[0].plot(t, s["num_running"], label=f"{name} running")
        axes[0].plot(t, s["num_waiting"], "--", label=f"{name} waiting")
        axes[1].plot(t, 100 * np.asarray(s["kv_usage"]), label=f"{name} KV blocks used")
        axes[1].plot(t, 100 * np.asarray(s["kv_waste"]), ":", label=f"{name} KV waste (of allocated)")
        occupancy = np.asarray(s["useful_tokens"]) / np.asarray(s["bucket_tokens"])
        axes[2].plot(t, 100 * occupancy, ".", markersize=3, label=name)
    axes[0].set_ylabel("requests")
    axes[1].set_ylabel("% of KV pool / allocated")
    axes[2].set_ylabel("useful slots per step %")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "steps.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def plot_latency_cdfs(out_dir: pathlib.Path, latencies_ms: Mapping[str, Mapping[str, Sequence[float]]]) -> list[pathlib.Path]:
    """One panel per metric (ttft, tpot, itl, e2el), one CDF line per run."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = ["ttft", "tpot", "itl", "e2el"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, metric in zip(axes, metrics):
        for name, values in latencies_ms.items():
            v = np.sort(np.asarray(values.get(metric, [])))
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "latency_cdfs.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]
