"""`cbjax bench serve --base-url URL`: drive any OpenAI-compatible server as `vllm bench serve` does.

Each request is a streaming POST /v1/completions (prompt as token ids, `max_tokens` its output
length, `ignore_eos` so lengths are forced, `stream_options.include_usage`). Requests are
released at the send offsets (`cbjax.bench.dataset.arrival_offsets`: Poisson for burstiness 1)
and, with `max_concurrency`, wait for a free slot (vLLM's semaphore); TTFT and E2EL count from
when a request was actually sent. As in vLLM's `async_request_openai_completions`, every SSE
chunk with choices is a token arrival (ITLs are the gaps between chunks), the output token
count comes from the final usage chunk, a request that streams no chunk failed, and one test
request goes first, outside the measurement.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence

from cbjax.bench.dataset import SyntheticRequest
from cbjax.bench.metrics import RequestTimeline

TIMEOUT_S = 6 * 3600  # vLLM's AIOHTTP_TIMEOUT: a benchmark request is never cut short by the client


def httpx_module():
    try:
        import httpx
    except ImportError as error:
        raise SystemExit("cbjax bench serve --base-url needs httpx: pip install 'cbjax[bench]'") from error
    return httpx


def served_model_name(base_url: str) -> str:
    """The first model GET /v1/models lists (what vLLM's benchmark uses when --model is not given)."""
    httpx = httpx_module()
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=30, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise SystemExit(
            f"could not read the served model from {base_url}/v1/models ({type(error).__name__}: {error}); "
            "is the server up at that URL? Or pass --model NAME"
        ) from error


async def sse_data(response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, as each line completes.

    Lines end at "\n" only: generated text inside the JSON may hold U+2028, U+0085 or other
    characters that `str.splitlines` (and so httpx's `aiter_lines`) would also break at.
    """
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data:"):  # anything else: blank separators, ":" keep-alive comments, event names
                yield line.removeprefix("data:").strip()
    if pending.startswith("data:"):
        yield pending.removeprefix("data:").strip()


async def stream_completion(client, url: str, payload: dict, timeline: RequestTimeline, start: float) -> str | None:
    """Send one streaming request, stamping its chunks on `timeline` (s from `start`); the error, if any."""
    timeline.send_time = time.perf_counter() - start
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                timeline.success = False
                return f"HTTP {response.status_code}: {body[:300]}"
            async for data in sse_data(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    timeline.token_times.append(time.perf_counter() - start)
                elif usage := chunk.get("usage"):
                    timeline.num_output_tokens = usage.get("completion_tokens")
                    timeline.prompt_len = usage.get("prompt_tokens") or timeline.prompt_len
    except Exception as error:  # noqa: BLE001 - any transport or protocol failure fails this request only
        timeline.success = False
        return f"{type(error).__name__}: {error}"
    if not timeline.token_times:
        timeline.success = False
        return "the stream carried no chunk with choices, so there is no TTFT"
    return None


async def drive_server(
    base_url: str,
    model: str,
    requests: Sequence[SyntheticRequest],
    send_offsets: Sequence[float],
    max_concurrency: int | None = None,
    extra_body: dict | None = None,
) -> tuple[list[RequestTimeline], list[str | None], float]:
    """Every request through the server: their timelines, their errors (None: fine) and the duration (s)."""
    httpx = httpx_module()
    url = f"{base_url}/v1/completions"
    timelines = [RequestTimeline(prompt_len=r.prompt_len, send_time=float("nan")) for r in requests]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or max(1, len(requests)), max_keepalive_connections=None)

    def payload(i: int) -> dict:
        return {
            "model": model, "prompt": requests[i].prompt_token_ids, "max_tokens": requests[i].output_len,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {}),
        }

    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, trust_env=False) as client:
        # vLLM's initial test run: one request first, so a wrong URL or model fails fast and the
        # client's first-connection costs stay out of the numbers.
        error = await stream_completion(client, url, payload(0), RequestTimeline(requests[0].prompt_len, 0.0), time.perf_counter())
        if error:
            raise SystemExit(f"the initial test request to {url} failed ({error}); check --base-url and --model")
        start = time.perf_counter()

        async def send(i: int) -> str | None:
            if slots is None:
                return await stream_completion(client, url, payload(i), timelines[i], start)
            async with slots:
                return await stream_completion(client, url, payload(i), timelines[i], start)

        tasks = []
        for i, offset in enumerate(send_offsets):
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(send(i)))
        errors = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return timelines, list(errors), duration
