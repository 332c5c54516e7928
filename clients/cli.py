"""The engine side of the `kvrc` command: `kvrc engine` and `kvrc demo`.

The `kvrc` console script (kvrc/cli.py) hands these two subcommands here and
every other one to coordinator/edges/cli.py, importing each side only when it
runs: a coordinator deployment needs no engine library, and `kvrc status` no
torch. `python -m clients.cli engine ...` is the same without the dispatcher
(the demo starts its engines so).

Errors a person can fix (bad flags, inconsistent credentials) print one line on
stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from clients.refengine.demo import add_demo_arguments  # torch-free
from clients.refengine.options import add_engine_arguments  # torch-free
from kvrc import __version__
from kvrc.credentials import CredentialsError

EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrc", description="KV reuse coordinator")
    parser.add_argument("--version", action="version", version=f"kvrc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine = commands.add_parser("engine", help="run one rank part of the reference engine")
    add_engine_arguments(engine)
    engine.set_defaults(func=_cmd_engine)
    demo = commands.add_parser("demo", help="kvrc + 2 prefill + 1 decode engines on loopback")
    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def _cmd_engine(args: argparse.Namespace) -> int:
    from clients.refengine.engine import run_from_args  # needs the engine extra (torch)

    return run_from_args(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from clients.refengine.demo import run_demo

    return run_demo(args)


def main(argv: Sequence[str] | None = None) -> int:
    """`argv` starts with the subcommand (`engine ...` or `demo ...`), as `kvrc` got it."""
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except CredentialsError as e:
        print(f"kvrc: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
