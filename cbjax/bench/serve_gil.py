"""Who holds the GIL in a running `cbjax serve`: a summary of `py-spy record --threads --gil --format raw`.

py-spy's --gil keeps only the samples whose thread held the GIL, so a thread's samples over the
samples taken (duration x rate) is the share of the run it held the GIL: the event loop's share
is the front end's Python work, the engine-core thread's the scheduler, step preparation and output
processing (waiting on the device step releases it).

    python -m cbjax.bench.serve_gil bench_results/cbjax_serve_gil.txt --seconds 60 --rate 100
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def thread_name(frame: str) -> str:
    """py-spy's first frame names the thread: `thread (1234): MainThread`."""
    return frame.split(": ", 1)[1] if ": " in frame else frame


def gil_shares(raw: str, num_samples: int, top: int = 5) -> dict[str, dict]:
    """Per thread: the share of `num_samples` in which it held the GIL, and its `top` innermost
    frames of our code (cbjax, kernels) or of the library where no frame of ours is on the stack."""
    held: collections.Counter[str] = collections.Counter()
    frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *calls = stack.split(";")
        name = thread_name(thread)
        held[name] += int(count)
        ours = [call for call in calls if "cbjax/" in call or "kernels_" in call]
        frames[name][(ours or calls or ["?"])[-1]] += int(count)
    return {
        name: {"gil_share": samples / num_samples, "top_frames": frames[name].most_common(top)}
        for name, samples in held.most_common()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record --threads --gil --format raw output")
    parser.add_argument("--seconds", type=float, required=True, help="how long py-spy sampled")
    parser.add_argument("--rate", type=int, required=True, help="py-spy's samples per second")
    args = parser.parse_args()
    for name, share in gil_shares(args.raw.read_text(), round(args.seconds * args.rate)).items():
        print(f"{name}: held the GIL {100 * share['gil_share']:.1f}% of the run")
        for frame, samples in share["top_frames"]:
            print(f"    {samples:6d}  {frame}")


if __name__ == "__main__":
    main()
