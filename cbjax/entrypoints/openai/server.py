"""`cbjax serve`: load and compile the model, start uvicorn, print the URL once /health answers 200,
drain on SIGTERM (within --shutdown-timeout, then abort what is left) and exit 0; exit 1 within a
second of the engine core dying (its cause in the log), so that a supervisor restarts the server."""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import logging
import os
import signal
import sys
import urllib.error
import urllib.request

import uvicorn
from prometheus_client import CollectorRegistry

from cbjax.checkpoint.resolve import BUILTIN_MODEL_NAME, resolve_model
from cbjax.entrypoints.cli.args import engine_options
from cbjax.engine.async_llm import AsyncLLM
from cbjax.engine.exceptions import EngineDeadError
from cbjax.entrypoints.openai.app import build_app
from cbjax.entrypoints.openai.lora_adapters import load_adapter, parse_lora_modules
from cbjax.entrypoints.openai.metrics import PrometheusStatLogger
from cbjax.entrypoints.openai.reasoning import reasoning_parser
from cbjax.entrypoints.openai.tool_parsers import tool_call_parser
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.heap import freeze_gc_heap

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5  # how often the server looks at the engine core (vLLM's launcher: its watchdog loop)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_serve(args: argparse.Namespace) -> None:
    api_key = args.api_key or os.environ.get("CBJAX_API_KEY") or None
    if not is_loopback(args.host) and api_key is None:
        logger.warning("binding %s without --api-key: anyone who can reach this port can use the model", args.host)
    model_dir = resolve_model(args.model)
    served_model_name = args.served_model_name or args.model or BUILTIN_MODEL_NAME
    registry = CollectorRegistry()
    engine = AsyncLLM(
        str(model_dir),
        stat_loggers=[functools.partial(PrometheusStatLogger, registry, served_model_name)],
        engine_process=args.engine_process and args.num_processes == 1,
        reasoning_parser=args.reasoning_parser,  # a constraint applies to the answer, not to the thinking
        **engine_options(args),
    )
    state = ServerState(engine, served_model_name, engine.engine_config.max_model_len, args.max_waiting_requests,
                        args.max_completions_per_request, args.max_stop_strings, reasoning_parser(args.reasoning_parser),
                        tool_call_parser(args.enable_auto_tool_choice, args.tool_call_parser))
    app = build_app(state, registry, api_key, args.max_request_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn re-raises the signal it drained on; a no-op handler makes that drained exit a clean 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    freeze_gc_heap()  # this process serves one engine until it exits: no GC pauses over its start-up objects
    try:
        for name, path in parse_lora_modules(args.lora_modules):
            asyncio.run(load_adapter(state, name, path))
        ok = asyncio.run(_serve(uvicorn.Server(config), engine, args, served_model_name))
    finally:
        engine.shutdown(timeout=args.shutdown_timeout)
    if not ok:
        sys.exit(1)


async def _serve(server: uvicorn.Server, engine: AsyncLLM, args: argparse.Namespace, served_model_name: str) -> bool:
    """Run until SIGTERM (True) or the engine core's death (False); announce the URL only once the
    server answers /health with 200."""
    serving = asyncio.create_task(server.serve())
    watchdog = asyncio.create_task(_stop_when_dead(server, engine))
    try:
        return await _announce_and_serve(server, serving, args, served_model_name) and not watchdog.done()
    finally:
        watchdog.cancel()


async def _stop_when_dead(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """Stop the server once the engine core is dead: its streams have their error events already,
    and every later request would get 503 (vLLM's launcher does the same)."""
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        try:
            engine.check_health()
        except EngineDeadError as error:
            logger.error("%s; stopping the server (exit 1) so that a supervisor can restart it", error)
            server.should_exit = True
            return


async def _announce_and_serve(
    server: uvicorn.Server, serving: asyncio.Task, args: argparse.Namespace, served_model_name: str
) -> bool:
    while not server.started:
        if serving.done():
            return False  # uvicorn said why (e.g. the port is taken)
        await asyncio.sleep(0.05)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    status = await asyncio.to_thread(_health_status, url)
    if status != 200:
        logger.error("/health answered %d after start-up; stopping", status)
        server.should_exit = True
        await serving
        return False
    print(f"cbjax serving {served_model_name} at {url} (OpenAI API: {url}/v1)", flush=True)
    await serving
    return True


def _health_status(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
