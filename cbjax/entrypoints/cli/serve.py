"""`cbjax serve` (the OpenAI-compatible server) and `cbjax worker` (a multi-host process > 0)."""

from __future__ import annotations

import argparse

from cbjax.entrypoints.cli.args import add_engine_args, add_serve_args, engine_options


def cmd_serve(args: argparse.Namespace) -> None:
    from cbjax.entrypoints.openai.server import cmd_serve as serve

    serve(args)


def cmd_worker(args: argparse.Namespace) -> None:
    from cbjax.worker.worker_process import run_worker

    run_worker(args.model, engine_options(args))


def add_serve_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    add_engine_args(p, model_positional=True, server=True)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="multi-host: a process > 0 that runs process 0's steps on its own devices")
    add_engine_args(p, server=True)  # the same defaults as `cbjax serve`: every process compiles the same steps
    p.set_defaults(func=cmd_worker)
