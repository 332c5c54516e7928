"""`kvrc` command line: `kvrc serve` and `kvrc status` (later: drain, demo, ...).

Errors a person can fix (bad flags, bad profiles file, unreachable target)
print one line on stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from coordinator.config import ConfigError, CoordinatorConfig, load_profiles
from kvrc import __version__
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

EXIT_CONFIG = 2
EXIT_UNREACHABLE = 1


class _JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(_JsonLogFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrc", description="KV reuse coordinator")
    parser.add_argument("--version", action="version", version=f"kvrc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    defaults = CoordinatorConfig()
    serve = commands.add_parser("serve", help="run the coordinator")
    serve.add_argument("--listen", default=defaults.listen, help="gRPC HOST:PORT (%(default)s)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help="Prometheus /metrics port; 0 = any free port, -1 = off (%(default)s)",
    )
    serve.add_argument(
        "--reuse",
        type=_on_off,
        default=defaults.reuse,
        metavar="{off,on}",
        help="experimental prefix reuse (default off)",
    )
    serve.add_argument("--profiles", type=Path, help="declared deployment profiles (TOML or YAML)")
    serve.add_argument("--heartbeat-interval-ms", type=int, default=defaults.heartbeat_interval_ms)
    serve.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=defaults.heartbeat_timeout_ms,
        help="a rank part silent this long is removed (%(default)s)",
    )
    serve.add_argument("--session-grace-ms", type=int, default=defaults.session_grace_ms)
    serve.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.shutdown_grace_s,
        help="time in-flight RPCs get to finish on SIGTERM (%(default)s)",
    )
    serve.add_argument(
        "--inventory-max-entries",
        type=int,
        default=defaults.inventory_max_entries_total,
        help="cap on (block, holder) inventory entries; stores past it are dropped (%(default)s)",
    )
    serve.add_argument(
        "--inventory-max-entries-per-engine",
        type=int,
        default=defaults.inventory_max_entries_per_engine,
        help="cap on one child engine's inventory entries (%(default)s)",
    )
    serve.add_argument("--port-file", type=Path, help="write the bound ports here as JSON")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--log-json", action="store_true", help="one JSON document per log line")
    serve.set_defaults(func=_cmd_serve)

    status = commands.add_parser("status", help="show engines, rank parts and readiness")
    status.add_argument("--target", default="127.0.0.1:50051", help="coordinator HOST:PORT")
    status.add_argument("--json", action="store_true", help="print one JSON document")
    status.add_argument("--timeout-s", type=float, default=5.0)
    status.set_defaults(func=_cmd_status)
    return parser


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    profiles = load_profiles(args.profiles) if args.profiles is not None else ()
    return CoordinatorConfig(
        listen=args.listen,
        metrics_port=args.metrics_port,
        reuse=args.reuse,
        declared_profiles=profiles,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        session_grace_ms=args.session_grace_ms,
        shutdown_grace_s=args.shutdown_grace_s,
        inventory_max_entries_total=args.inventory_max_entries,
        inventory_max_entries_per_engine=args.inventory_max_entries_per_engine,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.server import serve, split_host_port  # keeps `kvrc status` light

    _setup_logging(args.log_level, args.log_json)
    config = config_from_args(args)
    split_host_port(config.listen)
    return serve(config, args.port_file)


# --- status --------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def status_document(response: pb.StatusResponse) -> dict[str, Any]:
    """The `kvrc status --json` document; opaque bytes are base64."""
    children = []
    for child in response.child_engines:
        state = child.state
        children.append(
            {
                "child_engine_id": state.child_engine_id,
                "engine_id": state.engine_id,
                "ready": state.ready,
                "parts_present": state.parts_present,
                "parts_expected": state.parts_expected,
                "not_ready_reason": state.not_ready_reason,
                "compatibility_hash": state.compatibility_hash,
                "stale": state.stale,
                "inventory_entries": child.inventory_entries,
                "draining": state.draining,
                "reuse": {
                    "enabled": state.reuse.enabled,
                    "reason": pb.ReuseReason.Name(state.reuse.reason),
                    "detail": state.reuse.detail,
                },
                "profile": {
                    "model": child.profile.model,
                    "kv_dtype": child.profile.kv_dtype,
                    "block_size": child.profile.block_size,
                    "tp_size": child.profile.parallel.tp_size,
                    "pp_size": child.profile.parallel.pp_size,
                    "pcp_size": child.profile.parallel.pcp_size,
                    "dp_size": child.profile.parallel.dp_size,
                },
                "parts": [
                    {
                        "tp_rank": part.rank.tp_rank,
                        "pp_rank": part.rank.pp_rank,
                        "pcp_rank": part.rank.pcp_rank,
                        "session_id": part.session_id,
                        "incarnation": part.incarnation,
                        "last_heartbeat_unix_ms": part.last_heartbeat_unix_ms,
                        "endpoint": {
                            "backend": part.endpoint.backend,
                            "session_name": part.endpoint.session_name,
                            "agent_metadata_b64": _b64(part.endpoint.agent_metadata),
                            "num_regions": len(part.endpoint.regions),
                            "extra_b64": {k: _b64(v) for k, v in part.endpoint.extra.items()},
                        },
                    }
                    for part in child.parts
                ],
            }
        )
    return {
        "version": response.version,
        "reuse_enabled": response.reuse_enabled,
        "warming": response.warming,
        "inventory_entries": response.inventory_entries,
        "child_engines": children,
    }


def _status_text(target: str, response: pb.StatusResponse) -> str:
    lines = [
        f"kvrc {response.version} at {target}: reuse {'on' if response.reuse_enabled else 'off'}"
        f"{', warming' if response.warming else ''}, {len(response.child_engines)} child engine(s)"
        f", {response.inventory_entries} inventory entries"
    ]
    header = ("CHILD ENGINE", "ENGINE", "READY", "PARTS", "REUSE", "ENTRIES", "WHY NOT READY")
    rows = [header]
    for child in response.child_engines:
        s = child.state
        rows.append(
            (
                s.child_engine_id,
                s.engine_id,
                "yes" if s.ready else "no",
                f"{s.parts_present}/{s.parts_expected}",
                "on" if s.reuse.enabled else pb.ReuseReason.Name(s.reuse.reason)[13:].lower(),
                f"{child.inventory_entries}{' (stale)' if s.stale else ''}",
                s.not_ready_reason or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
    return "\n".join(lines)


def fetch_status(target: str, timeout_s: float) -> pb.StatusResponse:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        response: pb.StatusResponse = stub.GetStatus(pb.StatusRequest(), timeout=timeout_s)
        return response


def _cmd_status(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        response = fetch_status(args.target, args.timeout_s)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        name = code.name if code is not None else "ERROR"
        print(
            f"kvrc status: cannot get status from {args.target} "
            f"({name} after {time.monotonic() - started:.1f} s): {details}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(status_document(response), indent=2, sort_keys=True))
    else:
        print(_status_text(args.target, response))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except ConfigError as e:
        print(f"kvrc: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    return result
