"""`specjax` command line: one subcommand module per area (generate, train, bench, serve)."""

from __future__ import annotations

import argparse
import logging
import sys

from specjax.cli import bench, evaluate, generate, serve, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Lossless speculative decoding (DFlash) in JAX.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, train, bench, serve, evaluate):
        module.register(sub)
    return parser


def main(argv=None) -> int:
    from specjax.hostmem import keep_freed_memory

    keep_freed_memory()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s",
                        force=True)
    from specjax.config import ConfigError
    from specjax.engine.engine import RequestError
    from specjax.model.loader import CheckpointError
    from specjax.sampling import SamplingError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, RequestError, SamplingError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

