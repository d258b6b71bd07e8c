"""`cbjax convert | import-gguf | generate | serve | lower | worker | plan | bench`: one module per command."""

from __future__ import annotations

import argparse
import logging

from cbjax.entrypoints.cli.bench import add_bench_parser
from cbjax.entrypoints.cli.convert import add_convert_parsers
from cbjax.entrypoints.cli.generate import add_generate_parser
from cbjax.entrypoints.cli.lower import add_lower_parser
from cbjax.entrypoints.cli.plan import add_plan_parser
from cbjax.entrypoints.cli.serve import add_serve_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbjax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine decisions (INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_parsers(sub)
    add_generate_parser(sub)
    add_serve_parsers(sub)
    add_lower_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
