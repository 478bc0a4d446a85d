"""The ``tierswap`` command line: ``bench`` (measure and tune), ``inspect``, ``verify`` and
``snapshot``.

``main(argv)`` returns the exit status instead of exiting, so it can be called from Python and
tests; the ``tierswap`` console script and ``python -m tierswap`` both run it. Exit status: 0 on
success, 1 when ``verify`` finds damage, 2 for a usage or configuration error, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tierswap import __version__
from tierswap.cli._args import positive_int as positive_int_arg
from tierswap.cli._args import size as size_arg
from tierswap.cli._engines import DdEngine, FioEngine, StoreEngine, which
from tierswap.cli._measure import (
    Engine,
    Setting,
    bench_folder,
    check_free_space,
    drop_page_cache,
    random_source,
    run_trial,
)
from tierswap.cli._report import BenchReport, Result, print_table, write_json
from tierswap.errors import TierswapError

# ``main`` is the command line; the other names are the measuring toolkit ``tierswap bench`` is
# built from (engines, trials, reports, argparse types), public for the scripts in bench/.
__all__ = [
    "BenchReport",
    "DdEngine",
    "Engine",
    "FioEngine",
    "Result",
    "Setting",
    "StoreEngine",
    "bench_folder",
    "build_parser",
    "check_free_space",
    "drop_page_cache",
    "main",
    "positive_int_arg",
    "print_table",
    "random_source",
    "run_trial",
    "size_arg",
    "which",
    "write_json",
]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module."""
    from tierswap.cli import bench, inspect, snapshot, verify

    parser = argparse.ArgumentParser(
        prog="tierswap",
        description="Tiered GPU / host / NVMe swap space for PyTorch: disk benchmark and tuner, "
        "store inspection, verification and snapshots.",
    )
    parser.add_argument("--version", action="version", version=f"tierswap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (bench, inspect, verify, snapshot):
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except TierswapError as exc:
        print(f"tierswap {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"tierswap {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `tierswap inspect DIR | head`: the reader left, not an error
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
