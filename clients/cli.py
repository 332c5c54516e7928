"""The engine side of the `kvrc` command: `kvrc engine`, `kvrc demo` and `kvrc route`.

The `kvrc` console script (kvrc/cli.py) hands these three subcommands here and
every other one to coordinator/edges/cli.py, importing each side only when it
runs: a coordinator deployment needs no engine library, and `kvrc status` no
torch. `python -m clients.cli engine ...` is the same without the dispatcher
(the demo starts its engines so).

Errors a person can fix (bad flags, inconsistent credentials) print one line on
stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from clients.refengine.demo import add_demo_arguments  # torch-free
from clients.refengine.options import add_engine_arguments  # torch-free
from kvrc import __version__
from kvrc.credentials import ChannelOptions, CredentialsError
from kvrc.prompts import (
    add_target_argument,
    parse_block_hashes,
    parse_engine_ids,
    parse_mm_feature,
    parse_token_ids,
    read_token_ids,
    timeout_seconds,
    wire_text,
)

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
    route = commands.add_parser(
        "route", help="pick the prefill engine that holds most of a prompt (kvrc's Score)"
    )
    add_target_argument(route)
    route.add_argument(
        "--model", type=wire_text, required=True, help="the model the candidates serve"
    )
    route.add_argument(
        "--candidates",
        type=wire_text,
        required=True,
        help="candidate child engine ids, comma-separated",
    )
    prompt = route.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="token ids, comma-separated: 1,2,3")
    prompt.add_argument("--tokens-file", type=Path, help="a file of token ids")
    prompt.add_argument("--block-hashes", help="block hashes in hex, comma-separated")
    route.add_argument("--lora-name", type=wire_text, default="")
    route.add_argument("--lora-path", type=wire_text, default="")
    route.add_argument("--cache-salt", type=wire_text, default="")
    route.add_argument(
        "--mm-feature",
        type=wire_text,
        action="append",
        default=[],
        metavar="ID:OFFSET:LENGTH",
        help="a multimodal item of the token ids; repeat it, sorted by offset",
    )
    route.add_argument(
        "--timeout-s",
        type=timeout_seconds,
        default=5.0,
        help="the Score call's deadline (default 5); past it the first candidate is routed",
    )
    route.add_argument("--json", action="store_true", help="print one JSON document")
    # The same client flags as `kvrc status` (coordinator/edges/cli.py); a router token.
    route.add_argument("--tls-ca", type=Path, help="PEM CA that signed kvrc's certificate")
    route.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    route.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    route.add_argument("--tls-server-name", help="check kvrc's certificate against this name")
    route.add_argument("--token-file", type=Path, help="file holding a router bearer token")
    route.set_defaults(func=_cmd_route)
    return parser


def _cmd_engine(args: argparse.Namespace) -> int:
    from clients.refengine.engine import run_from_args  # needs the engine extra (torch)

    return run_from_args(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from clients.refengine.demo import run_demo

    return run_demo(args)


def _cmd_route(args: argparse.Namespace) -> int:
    from clients.router import ScoreClient, ScoreRouter  # grpc only, no torch

    candidates = parse_engine_ids(args.candidates)
    try:
        if not candidates:
            raise ValueError("--candidates: name at least one child engine")
        tokens: list[int] | None = None
        hashes: list[bytes] | None = None
        if args.tokens is not None:
            tokens = parse_token_ids(args.tokens, "--tokens")
        elif args.tokens_file is not None:
            tokens = read_token_ids(args.tokens_file, "--tokens-file")
        else:
            hashes = parse_block_hashes(args.block_hashes, "--block-hashes")
            if args.mm_feature:
                raise ValueError("--mm-feature goes with --tokens or --tokens-file")
        mm_features = [parse_mm_feature(text, "--mm-feature") for text in args.mm_feature]
    except ValueError as e:
        print(f"kvrc route: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    options = ChannelOptions(
        args.target,
        ca_cert=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        server_name=args.tls_server_name,
        token_file=args.token_file,
    )

    async def run() -> tuple[str, str, bool]:
        async with ScoreClient(options) as client:
            route = await ScoreRouter(client, args.model).route(
                candidates,
                token_ids=tokens,
                block_hashes=hashes,
                lora_name=args.lora_name,
                lora_path=args.lora_path,
                cache_salt=args.cache_salt,
                mm_features=mm_features,
                timeout_s=args.timeout_s,
            )
            if route.score_failed:  # stdout still names the fallback, for the caller
                print(f"kvrc route: warning: {route.why}", file=sys.stderr)
            return route.child_engine_id, route.why, route.score is not None

    engine, why, scored = asyncio.run(run())
    if args.json:
        print(json.dumps({"child_engine_id": engine, "why": why, "by_score": scored}))
    else:
        print(f"{engine}: {why}")
    return 0


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
