"""A/B: handing a step's outputs to AsyncLLM's streams one call_soon_threadsafe per output, or one
per step and event loop (`cbjax.engine.core_client.deliver_all`); prints one JSON object.

    PYTHONPATH=. python benchmarks/async_delivery_ab.py --streams 256 --steps 200 --rounds 3

An event loop in one thread runs `--streams` consumers, each awaiting its asyncio queue as
AsyncLLM.generate does; the engine's thread (here: the main thread) delivers `--steps` steps of
one item per stream, waiting after each step until every consumer has read its item (a device
step's pace, with nothing else running). Per side: the delivering thread's time per step, and the
whole step's (delivery until the last consumer has its item). Sides alternate within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

from cbjax.engine.core_client import LoopQueueSink, deliver, deliver_all


def run_side(side: str, num_streams: int, num_steps: int) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    ready, done_step = threading.Event(), threading.Semaphore(0)
    queues: list[asyncio.Queue] = []

    async def consumer(queue: asyncio.Queue, counter: list[int]) -> None:
        for _ in range(num_steps):
            await queue.get()
            counter[0] += 1
            if counter[0] == num_streams:  # the step's last item: tell the engine's thread
                counter[0] = 0
                done_step.release()

    async def main() -> None:
        counter = [0]
        queues.extend(asyncio.Queue() for _ in range(num_streams))
        tasks = [asyncio.create_task(consumer(queue, counter)) for queue in queues]
        ready.set()
        await asyncio.gather(*tasks)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait()
    sinks = [LoopQueueSink(loop, queue) for queue in queues]
    deliver_times, step_times = [], []
    for step in range(num_steps):
        start = time.perf_counter()
        if side == "per_output":
            for sink in sinks:
                deliver(sink, step)
        else:
            deliver_all([(sink, step) for sink in sinks])
        delivered = time.perf_counter()
        done_step.acquire()
        deliver_times.append(delivered - start)
        step_times.append(time.perf_counter() - start)
    thread.join()
    loop.close()
    return {"deliver_us_per_step": statistics.median(deliver_times) * 1e6,
            "step_us_per_step": statistics.median(step_times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for round_index in range(args.rounds):
        sides = ["per_output", "per_step"] if round_index % 2 == 0 else ["per_step", "per_output"]
        for side in sides:
            runs.append({"side": side, "round": round_index, **run_side(side, args.streams, args.steps)})
            print(json.dumps(runs[-1]), flush=True)
    medians = {side: {key: statistics.median(r[key] for r in runs if r["side"] == side)
                      for key in ("deliver_us_per_step", "step_us_per_step")} for side in ("per_output", "per_step")}
    print(json.dumps({"streams": args.streams, "steps": args.steps, "rounds": args.rounds, "medians": medians,
                      "per_step_over_per_output": {key: medians["per_step"][key] / medians["per_output"][key]
                                                   for key in medians["per_step"]}}, indent=1))


if __name__ == "__main__":
    main()
