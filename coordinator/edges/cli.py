"""`kvrc` command line: `kvrc serve`, `status`, `score`, `drain`, `quarantine resolve`.

Errors a person can fix (bad flags, bad profiles file, unreachable target)
print one line on stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc

from coordinator.core.auth import AuthConfigError, load_auth_policy
from coordinator.core.cost_model import MIB, CostConfig
from coordinator.core.leases import LeaseConfig
from coordinator.core.recovery import MAX_STATE_FILE_BYTES, is_state_file
from coordinator.edges.host_patterns import check_host_patterns
from coordinator.runtime.config import (
    DEFAULT_ORIGIN_TIMEOUT_MS,
    DEFAULT_OUTBOX_MAX_BYTES,
    MAX_ORIGIN_TIMEOUT_MS,
    MIN_ORIGIN_TIMEOUT_MS,
    MIN_OUTBOX_MAX_BYTES,
    STORE_PASSWORD_ENV,
    ConfigError,
    CoordinatorConfig,
    FieldBounds,
    load_declarations,
    parse_store,
    read_store_password,
)
from kvrc import __version__
from kvrc.credentials import ChannelOptions, CredentialsError, connect_blocking
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
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

EXIT_CONFIG = 2
EXIT_UNREACHABLE = 1  # also: the coordinator refused the request (the message says why)
EXIT_NOT_SAFE = 3  # `kvrc drain --wait`: leases remain at the timeout


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


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, naming --help, like every other kvrc error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def _uint32(value: str) -> int:
    """A protobuf uint32 flag: refused here, not by protobuf with a traceback."""
    number = _integer(value)
    if not 0 <= number < 1 << 32:
        raise argparse.ArgumentTypeError(f"must be in [0, {(1 << 32) - 1}], got {number}")
    return number


def _positive_int(value: str) -> int:
    """A count or size that must be at least 1 (a bound of 0 would refuse everything)."""
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {number}")
    return number


def _host_patterns(value: str) -> tuple[str, ...]:
    patterns = tuple(p.strip() for p in value.split(",") if p.strip())
    try:
        check_host_patterns(patterns)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return patterns


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvrc",
        description="KV reuse coordinator",
        epilog="engine-side commands: 'kvrc engine' (a reference engine rank part), "
        "'kvrc demo' (the demo cluster) and 'kvrc route' (pick the engine with the best "
        "Score); see 'kvrc engine --help'",
    )
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
    serve.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=defaults.heartbeat_interval_ms,
        help=f"how often engines are asked to heartbeat ({defaults.heartbeat_interval_ms})",
    )
    serve.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=defaults.heartbeat_timeout_ms,
        help="a rank part silent this long is removed (%(default)s)",
    )
    serve.add_argument(
        "--session-grace-ms",
        type=int,
        default=defaults.session_grace_ms,
        help="after a session closes, how long before its part counts as gone for its "
        f"leases ({defaults.session_grace_ms})",
    )
    serve.add_argument(
        "--resync-retry-ms",
        type=int,
        default=defaults.resync_retry_initial_ms,
        help="resend a ResyncRequest after this long without a dump, doubling (%(default)s)",
    )
    serve.add_argument(
        "--resync-retry-max-ms",
        type=int,
        default=defaults.resync_retry_max_ms,
        help="longest wait between ResyncRequests to one stale stream (%(default)s)",
    )
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
    lease_defaults = defaults.leases
    serve.add_argument(
        "--handoff-heartbeat-timeout-ms",
        type=int,
        default=lease_defaults.handoff_heartbeat_timeout_ms,
        help="a handoff lease not extended this long is aborted (%(default)s)",
    )
    serve.add_argument(
        "--handoff-max-lifetime-ms",
        type=int,
        default=lease_defaults.handoff_max_lifetime_ms,
        help="an ACTIVE handoff lease is extended at most this long after its begin, "
        "then aborted like a silent one (%(default)s)",
    )
    serve.add_argument(
        "--abort-timeout-ms",
        type=int,
        default=lease_defaults.abort_timeout_ms,
        help="an abort not acknowledged this long sends the lease to quarantine (%(default)s)",
    )
    serve.add_argument(
        "--handoff-publish-timeout-ms",
        type=int,
        default=lease_defaults.handoff_publish_timeout_ms,
        help="a handoff waiting for its prefill's publish this long fails (%(default)s)",
    )
    serve.add_argument(
        "--handoff-ready-max-wait-ms",
        type=int,
        default=lease_defaults.handoff_ready_max_wait_ms,
        help="a published handoff no decode began this long fails (%(default)s)",
    )
    serve.add_argument(
        "--tls-cert", type=Path, help="PEM server certificate (chain): TLS on the gRPC port"
    )
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca",
        type=Path,
        help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
    )
    serve.add_argument(
        "--auth-tokens",
        type=Path,
        metavar="FILE",
        help="credentials file (TOML): bearer tokens and certificate identities, each bound to "
        "engine ids and roles; every RPC then needs one (docs/security.md)",
    )
    serve.add_argument(
        "--state-file",
        type=Path,
        metavar="FILE",
        help="keep the known child engines here; after a restart kvrc warms up until they "
        "are back or --warmup-ms passes (docs/operations.md)",
    )
    serve.add_argument(
        "--warmup-ms",
        type=int,
        help="warm-up deadline after a restart (default 10000 with --state-file; without "
        "one, warm up exactly this long)",
    )
    serve.add_argument(
        "--session-queue-size",
        type=int,
        default=defaults.session_queue_size,
        help="messages queued to one session before an engine that does not read its stream "
        "is disconnected (%(default)s)",
    )
    serve.add_argument(
        "--max-rank-parts",
        type=_positive_int,
        default=defaults.max_rank_parts,
        help="rank parts registered at once, over all engines; one engine (its DP ranks "
        "together) may hold a quarter (%(default)s)",
    )
    serve.add_argument(
        "--max-endpoint-bytes",
        type=_positive_int,
        default=defaults.max_endpoint_bytes,
        help="bytes of the registered parts' transfer endpoints (agent metadata, extra, "
        "regions), over all of them; one engine may hold a quarter (%(default)s)",
    )
    serve.add_argument(
        "--max-kv-event-streams",
        type=_positive_int,
        default=defaults.max_kv_event_streams,
        help="vLLM KV-event subscriptions at once (one per child engine that names an "
        "endpoint, a few file descriptors each); past it an engine registers without one "
        "(%(default)s)",
    )
    serve.add_argument(
        "--kv-events-hosts",
        type=_host_patterns,
        default=(),
        metavar="LIST",
        help="hosts kvrc may subscribe to (or bind) for an engine's vLLM KV events, "
        "comma-separated: addresses, networks (10.0.0.0/8), names, *.domain; a "
        "registration naming another is PERMISSION_DENIED (default: any)",
    )
    serve.add_argument(
        "--store",
        default="memory",
        metavar="URL",
        help="memory (one process's view, the default) or redis://HOST:PORT/DB, "
        "rediss://HOST:PORT/DB (TLS): replicas share the inventory through that Redis",
    )
    serve.add_argument(
        "--store-password-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the Redis password (else ${STORE_PASSWORD_ENV}; never in the URL)",
    )
    serve.add_argument(
        "--store-tls-ca", type=Path, metavar="FILE", help="PEM CA of the rediss:// server"
    )
    serve.add_argument(
        "--store-snapshot-entries",
        type=int,
        default=defaults.store.snapshot_every_entries,
        metavar="N",
        help="write a snapshot of the shared view after N log entries (0 = never; %(default)s)",
    )
    serve.add_argument(
        "--store-snapshot-interval-s",
        type=float,
        default=defaults.store.snapshot_interval_ms / 1000,
        metavar="S",
        help="... or S seconds after the newest snapshot, if the log moved (%(default)s)",
    )
    # Default None, so that one given without a Redis store is refused.
    serve.add_argument(
        "--store-origin-timeout-ms",
        type=int,
        metavar="N",
        help="another replica silent (no heartbeat in the log) this long leaves this "
        f"replica's view with its engines and parts (default {DEFAULT_ORIGIN_TIMEOUT_MS}, "
        f"{MIN_ORIGIN_TIMEOUT_MS}..{MAX_ORIGIN_TIMEOUT_MS})",
    )
    serve.add_argument(
        "--store-outbox-max-bytes",
        type=int,
        metavar="N",
        help="bytes of ops queued while Redis cannot be reached; past it this replica's "
        f"part of the view is rebuilt from full dumps (default {DEFAULT_OUTBOX_MAX_BYTES}, "
        f"at least {MIN_OUTBOX_MAX_BYTES})",
    )
    cost = defaults.cost
    serve.add_argument(
        "--cost-gate",
        type=_on_off,
        default=cost.gate,
        metavar="{off,on}",
        help="with reuse on, grant a prefix load only when it is predicted to beat "
        "recomputing (default on; docs/cost_model.md)",
    )
    serve.add_argument(
        "--cost-safety-margin",
        type=float,
        default=cost.safety_margin,
        help="grant when predicted load x this < predicted recompute (%(default)s)",
    )
    serve.add_argument(
        "--cost-max-pairs",
        type=int,
        default=cost.max_pairs,
        help="(holder, requester, tier) links the cost model keeps, LRU (%(default)s)",
    )
    serve.add_argument(
        "--cost-default-bandwidth-gbps",
        type=float,
        default=cost.default_bandwidth_bytes_per_s / 1e9,
        help="an unmeasured link's bandwidth in gigabytes per second (GB/s: bytes, not "
        "Gb/s; 10 = 80 Gbit/s) (%(default)s)",
    )
    serve.add_argument(
        "--cost-default-latency-ms",
        type=float,
        default=cost.default_latency_ms,
        help="an unmeasured link's fixed latency (%(default)s)",
    )
    serve.add_argument(
        "--cost-default-prefill-tokens-per-s",
        type=float,
        default=cost.default_prefill_tokens_per_s,
        help="a requester's prefill rate before it reports one, unless its declared profile "
        "names prefill_tokens_per_s (%(default)s)",
    )
    serve.add_argument(
        "--cost-probe-mib",
        type=float,
        default=cost.probe_bytes / MIB,
        help="a load over a link without a fresh fit or a declaration ([[link]]) moves "
        "at most this many MiB (unless its reverse or its expired fit says the whole load "
        "pays) (fractions allowed; at least one block), the rest is recomputed: a "
        "probe that measures the link; 0: no probes (%(default)g)",
    )
    serve.add_argument(
        "--cost-reverse-prior",
        type=_on_off,
        default=cost.reverse_prior,
        metavar="{off,on}",
        help="a link that no [[link]] declares, without a fit of its own, stands on its "
        "measured reverse (the same pair the other way): the reverse spares it a probe when "
        "it says the load pays, never forbids one; off: each direction is probed on its own "
        "(default on)",
    )
    serve.add_argument(
        "--cost-measurement-ttl-s",
        type=float,
        default=cost.measurement_ttl_s,
        help="a link's measured fit is trusted this long after its last sample, then "
        "re-learnt: a link refused as slow is probed again (a refusal is never for good), "
        "and one idle for longer stands on its old fit until its next load; a measured "
        "prefill rate is dropped as long after its last sample (the declared or default "
        "rate applies again); 0: for ever "
        "(%(default)g)",
    )
    serve.add_argument("--port-file", type=Path, help="write the bound ports here as JSON")
    serve.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the lowest level logged (INFO)",
    )
    serve.add_argument("--log-json", action="store_true", help="one JSON document per log line")
    serve.set_defaults(func=_cmd_serve)

    status = commands.add_parser("status", help="show engines, rank parts and readiness")
    add_target_argument(status)
    status.add_argument("--json", action="store_true", help="print one JSON document")
    status.add_argument(
        "--max-leases",
        type=_uint32,
        default=0,
        metavar="N",
        help="list at most N open leases, quarantined first, then by deadline (default: "
        "the coordinator's, 1,000; it refuses more than 10,000); the total is always shown",
    )
    status.add_argument(
        "--timeout-s", type=timeout_seconds, default=5.0, help="the call's deadline (%(default)g)"
    )
    _add_client_security(status)
    status.set_defaults(func=_cmd_status)

    score = commands.add_parser(
        "score", help="how much of a prompt each child engine holds (the router's Score)"
    )
    add_target_argument(score)
    score.add_argument(
        "--model", type=wire_text, required=True, help="the model whose engines to score"
    )
    prompt = score.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="token ids, comma-separated: 1,2,3")
    prompt.add_argument(
        "--tokens-file",
        type=Path,
        help="a file of token ids (a JSON list, or separated by commas/space)",
    )
    prompt.add_argument(
        "--block-hashes", help="the chain's block hashes in hex, comma-separated (first first)"
    )
    score.add_argument(
        "--candidates",
        type=wire_text,
        default="",
        help="child engine ids, comma-separated (default: all)",
    )
    score.add_argument(
        "--lora-name", type=wire_text, default="", help="the request's LoRA adapter name"
    )
    score.add_argument(
        "--lora-path", type=wire_text, default="", help="the adapter's lora_path on the engines"
    )
    score.add_argument("--cache-salt", type=wire_text, default="", help="the request's cache_salt")
    score.add_argument(
        "--mm-feature",
        type=wire_text,
        action="append",
        default=[],
        metavar="ID:OFFSET:LENGTH",
        help="a multimodal item of the token ids (vLLM's identifier, first placeholder "
        "token, placeholder tokens); repeat it, sorted by offset",
    )
    score.add_argument("--group-idx", type=_uint32, default=0, help="KV-cache group (0)")
    score.add_argument("--json", action="store_true", help="print one JSON document")
    score.add_argument(
        "--timeout-s", type=timeout_seconds, default=5.0, help="the call's deadline (%(default)g)"
    )
    _add_client_security(score)
    score.set_defaults(func=_cmd_score)

    drain = commands.add_parser(
        "drain", help="stop new grants from/to an engine; report when it is safe to stop"
    )
    drain.add_argument(
        "engine", type=wire_text, metavar="ENGINE", help="a child engine id or an engine id"
    )
    add_target_argument(drain)
    drain.add_argument(
        "--timeout-ms",
        type=_uint32,
        default=0,
        help="then running leases are aborted (0 = the coordinator's default, 60000)",
    )
    drain.add_argument("--wait", action="store_true", help="block until safe to stop or timeout")
    drain.add_argument("--json", action="store_true", help="print one JSON document")
    _add_client_security(drain)
    drain.set_defaults(func=_cmd_drain)

    quarantine = commands.add_parser("quarantine", help="leases whose outcome is unknown")
    q_commands = quarantine.add_subparsers(dest="quarantine_command", required=True)
    resolve = q_commands.add_parser(
        "resolve", help="an operator proved the blocks quiet: release the quarantined lease"
    )
    resolve.add_argument("lease_id", type=wire_text, metavar="LEASE_ID")
    resolve.add_argument(
        "--note", type=wire_text, default="", help="why it is safe (logged by the coordinator)"
    )
    add_target_argument(resolve)
    resolve.add_argument("--json", action="store_true", help="print one JSON document")
    _add_client_security(resolve)
    resolve.set_defaults(func=_cmd_quarantine_resolve)
    return parser


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", type=Path, help="PEM CA that signed kvrc's certificate: TLS")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="check kvrc's certificate against this name, not the host"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="file holding a bearer token (admin or read role; router for score)",
    )


def channel_options_from_args(args: argparse.Namespace) -> ChannelOptions:
    """CredentialsError (reported by `main` as a configuration error) when inconsistent."""
    return ChannelOptions(
        args.target,
        ca_cert=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        server_name=args.tls_server_name,
        token_file=args.token_file,
    )


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    from coordinator.edges.tls import (  # keeps the pure imports light
        tls_files_from_flags,
        warn_of_open_secret_file,
    )

    profiles, links = load_declarations(args.profiles) if args.profiles is not None else ((), ())
    tls = tls_files_from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)
    try:
        auth = load_auth_policy(args.auth_tokens) if args.auth_tokens is not None else None
    except AuthConfigError as e:
        raise ConfigError(str(e)) from None
    for flag, given in (
        ("--store-password-file", args.store_password_file),
        ("--store-origin-timeout-ms", args.store_origin_timeout_ms),
        ("--store-outbox-max-bytes", args.store_outbox_max_bytes),
    ):
        if args.store == "memory" and given is not None:
            raise ConfigError(f"{flag} needs a redis:// or rediss:// store")
    origin_timeout_ms = args.store_origin_timeout_ms
    if origin_timeout_ms is None:
        origin_timeout_ms = DEFAULT_ORIGIN_TIMEOUT_MS
    elif not MIN_ORIGIN_TIMEOUT_MS <= origin_timeout_ms <= MAX_ORIGIN_TIMEOUT_MS:
        raise ConfigError(
            f"--store-origin-timeout-ms must be {MIN_ORIGIN_TIMEOUT_MS}..{MAX_ORIGIN_TIMEOUT_MS}"
            f" ms (at least four of the store's heartbeats), got {origin_timeout_ms}"
        )
    outbox = args.store_outbox_max_bytes
    if outbox is None:
        outbox = DEFAULT_OUTBOX_MAX_BYTES
    elif outbox < MIN_OUTBOX_MAX_BYTES:
        raise ConfigError(
            f"--store-outbox-max-bytes must be >= {MIN_OUTBOX_MAX_BYTES} (16 MiB: one "
            f"engine message's ops must fit), got {outbox}"
        )
    if args.store_tls_ca is not None and not args.store_tls_ca.is_file():
        raise ConfigError(f"--store-tls-ca {args.store_tls_ca}: no such file")
    if args.store_snapshot_entries < 0:
        raise ConfigError(
            f"--store-snapshot-entries must be >= 0, got {args.store_snapshot_entries}"
        )
    if not args.store_snapshot_interval_s > 0:
        raise ConfigError(
            f"--store-snapshot-interval-s must be > 0, got {args.store_snapshot_interval_s}"
        )
    store = dataclasses.replace(
        parse_store(
            args.store,
            password=read_store_password(args.store_password_file, os.environ),
            tls_ca=args.store_tls_ca,
        ),
        snapshot_every_entries=args.store_snapshot_entries,
        snapshot_interval_ms=max(1, round(args.store_snapshot_interval_s * 1000)),
        origin_timeout_ms=origin_timeout_ms,
        outbox_max_bytes=outbox,
    )
    try:
        leases = LeaseConfig(
            handoff_heartbeat_timeout_ms=args.handoff_heartbeat_timeout_ms,
            handoff_max_lifetime_ms=args.handoff_max_lifetime_ms,
            abort_timeout_ms=args.abort_timeout_ms,
            handoff_publish_timeout_ms=args.handoff_publish_timeout_ms,
            handoff_ready_max_wait_ms=args.handoff_ready_max_wait_ms,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None
    try:
        cost = CostConfig(
            gate=args.cost_gate,
            safety_margin=args.cost_safety_margin,
            max_pairs=args.cost_max_pairs,
            max_requesters=max(args.cost_max_pairs, 1),
            default_bandwidth_bytes_per_s=args.cost_default_bandwidth_gbps * 1e9,
            default_latency_ms=args.cost_default_latency_ms,
            default_prefill_tokens_per_s=args.cost_default_prefill_tokens_per_s,
            probe_bytes=_probe_bytes(args.cost_probe_mib),
            reverse_prior=args.cost_reverse_prior,
            measurement_ttl_s=args.cost_measurement_ttl_s,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        flag = _COST_FLAGS.get(name, "--cost-*")
        if name == "default_bandwidth_bytes_per_s":  # in the flag's unit, not the field's
            raise ConfigError(
                f"{flag}: must be in (0, 10000] GB/s, got {args.cost_default_bandwidth_gbps!r}"
            ) from None
        raise ConfigError(f"{flag}: {e}") from None
    # Once the configuration holds (a refused one says one line); the TLS key's at serve
    # start, once its PEM files were read. The credentials file may hold only digests
    # (sha256 =): changing it is the risk.
    warn_of_open_secret_file("--auth-tokens", args.auth_tokens, secret_content=False)
    warn_of_open_secret_file("--store-password-file", args.store_password_file, secret_content=True)
    return CoordinatorConfig(
        listen=args.listen,
        metrics_port=args.metrics_port,
        reuse=args.reuse,
        declared_profiles=profiles,
        declared_links=links,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        session_grace_ms=args.session_grace_ms,
        shutdown_grace_s=args.shutdown_grace_s,
        inventory_max_entries_total=args.inventory_max_entries,
        inventory_max_entries_per_engine=args.inventory_max_entries_per_engine,
        leases=leases,
        tls=tls,
        auth=auth,
        session_queue_size=args.session_queue_size,
        max_rank_parts=args.max_rank_parts,
        max_endpoint_bytes=args.max_endpoint_bytes,
        max_kv_event_streams=args.max_kv_event_streams,
        bounds=FieldBounds(kv_events_hosts=args.kv_events_hosts),
        state_file=args.state_file,
        warmup_ms=args.warmup_ms,
        resync_retry_initial_ms=args.resync_retry_ms,
        resync_retry_max_ms=args.resync_retry_max_ms,
        store=store,
        cost=cost,
    )


def _probe_bytes(mib: float) -> int:
    """MiB to whole bytes, rounded up: any positive probe stays a probe (of one block
    at least) rather than rounding to 0, which turns probes off."""
    if not (math.isfinite(mib) and mib >= 0):
        raise ValueError(f"probe_bytes must be a finite number of MiB, 0 or more, got {mib}")
    return math.ceil(mib * MIB)


_COST_FLAGS = {
    "safety_margin": "--cost-safety-margin",
    "max_pairs": "--cost-max-pairs",
    "max_requesters": "--cost-max-pairs",
    "default_bandwidth_bytes_per_s": "--cost-default-bandwidth-gbps",
    "default_latency_ms": "--cost-default-latency-ms",
    "default_prefill_tokens_per_s": "--cost-default-prefill-tokens-per-s",
    "probe_bytes": "--cost-probe-mib",
    "measurement_ttl_s": "--cost-measurement-ttl-s",
}


def _cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.edges.server import serve  # keeps `kvrc status` light

    _setup_logging(args.log_level, args.log_json)
    config = config_from_args(args)
    for flag, path in (("--port-file", args.port_file), ("--state-file", args.state_file)):
        folder = path.parent if path is not None else None
        if folder is not None and not (folder.is_dir() and os.access(folder, os.W_OK)):
            # Written once serving: refused now, in one line, rather than failing then.
            raise ConfigError(f"{flag} {path}: {folder} is not a writable directory")
    if args.state_file is not None:
        _check_state_file(args.state_file)
    return serve(config, args.port_file)


def _check_state_file(path: Path) -> None:
    """kvrc replaces its state file as it runs: what is there must be its own."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STATE_FILE_BYTES + 1)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"--state-file {path}: cannot read: {e.strerror or e}") from None
    if not is_state_file(data):
        raise ConfigError(
            f"--state-file {path}: the file there is not a kvrc state file, and kvrc "
            "would replace it: move it away or name another path"
        )


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
                    "reason": _enum_name(pb.ReuseReason, state.reuse.reason),
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
        "child_engines_total": _child_engines_total(response),
        "leases": [lease_document(lease) for lease in response.leases],
        "leases_total": _leases_total(response),
        "cost_model": cost_model_document(response.cost_model),
        "store": {
            "url": response.store or "memory",
            "available": not response.store_unavailable_reason,
            "unavailable_reason": response.store_unavailable_reason,
            "remote_child_engines": response.remote_child_engines,
        },
    }


def lease_document(lease: pb.LeaseStatus) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "flow": lease.flow,
        "state": _enum_name(pb.LeaseState, lease.state, "LEASE_STATE_"),
        "source_child_engine_id": lease.source_child_engine_id,
        "target_child_engine_id": lease.target_child_engine_id,
        "deadline_unix_ms": lease.deadline_unix_ms,
        "reason": lease.reason,
        "prediction": prediction_document(lease.prediction)
        if lease.HasField("prediction")
        else None,
    }


def _enum_name(enum: Any, value: int, prefix: str = "") -> str:
    """`value`'s name without `prefix`. A number this client does not know (a newer
    coordinator's value, or a broken answer) is shown as such instead of failing."""
    if value in enum.values():
        return str(enum.Name(value)).removeprefix(prefix)
    return f"{enum.DESCRIPTOR.name}({value})"


def _tier_name(tier: int) -> str:
    return _enum_name(pb.Tier, tier, "TIER_").lower()


def prediction_document(p: pb.CostPrediction) -> dict[str, Any]:
    return {
        "load_ms": p.load_ms,
        "recompute_ms": p.recompute_ms,
        "safety_margin": p.safety_margin,
        "worth_loading": p.worth_loading,
        "num_bytes": p.num_bytes,
        "num_tokens": p.num_tokens,
        "holder_child_engine_id": p.holder_child_engine_id,
        "tier": _tier_name(p.tier),
        "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s,
        "latency_ms": p.latency_ms,
        "link_samples": p.link_samples,
        "link_prior": p.link_prior,
        "prefill_tokens_per_s": p.prefill_tokens_per_s,
        "prefill_source": p.prefill_source,
        "detail": p.detail,
    }


def cost_model_document(cost: pb.CostModelStatus) -> dict[str, Any]:
    return {
        "gate": cost.gate,
        "safety_margin": cost.safety_margin,
        "max_pairs": cost.max_pairs,
        "probe_bytes": cost.probe_bytes,
        "reverse_prior": cost.reverse_prior,
        "measurement_ttl_s": cost.measurement_ttl_s,
        "defaults": {
            "bandwidth_bytes_per_s": cost.default_bandwidth_bytes_per_s,
            "latency_ms": cost.default_latency_ms,
            "prefill_tokens_per_s": cost.default_prefill_tokens_per_s,
        },
        "links": [
            {
                "holder_child_engine_id": link.holder_child_engine_id,
                "requester_child_engine_id": link.requester_child_engine_id,
                "tier": _tier_name(link.tier),
                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                "latency_ms": link.latency_ms,
                "samples": link.samples,
                "age_ms": link.age_ms if link.age_ms >= 0 else None,
                "expired": _expired(cost, link),
            }
            for link in cost.links
        ],
        "prefill_rates": [
            {
                "child_engine_id": rate.child_engine_id,
                "tokens_per_s": rate.tokens_per_s,
                "samples": rate.samples,
                "source": rate.source,
            }
            for rate in cost.prefill_rates
        ],
    }


def _expired(cost: pb.CostModelStatus, link: pb.LinkCost) -> bool:
    """Past --cost-measurement-ttl-s: the fit only stands in until its next sample."""
    ttl_ms = cost.measurement_ttl_s * 1000
    return ttl_ms > 0 and link.age_ms >= ttl_ms


def _cost_lines(cost: pb.CostModelStatus) -> list[str]:
    lines = [
        f"cost gate {'on' if cost.gate else 'off'}: load x {cost.safety_margin:g} < recompute; "
        f"{len(cost.links)}/{cost.max_pairs} measured link(s); cold defaults "
        f"{cost.default_bandwidth_bytes_per_s / 1e9:g} GB/s + {cost.default_latency_ms:g} ms, "
        f"{cost.default_prefill_tokens_per_s:g} tokens/s; "
        + (
            f"probes of {cost.probe_bytes / MIB:g} MiB over links without a fresh fit or a "
            "declaration"
            if cost.probe_bytes
            else "no probes"
        )
        + (
            "; an undeclared link stands on its measured reverse (which may spare a probe)"
            if cost.reverse_prior
            else ""
        )
        + (
            f"; a fit is re-learnt {cost.measurement_ttl_s:g} s after its last sample"
            if cost.measurement_ttl_s > 0
            else "; fits never expire"
        )
    ]
    for link in cost.links:
        age = ""
        if link.age_ms >= 0:
            age = f", last {link.age_ms / 1000:.3g} s ago"
            if _expired(cost, link):
                age += " (expired: re-learnt from its next sample)"
        lines.append(
            f"  link {link.holder_child_engine_id} -> {link.requester_child_engine_id} "
            f"({_tier_name(link.tier)}): {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s + "
            f"{link.latency_ms:.3g} ms, {link.samples} sample(s){age}"
        )
    for rate in cost.prefill_rates:
        lines.append(
            f"  prefill {rate.child_engine_id}: {rate.tokens_per_s:.4g} tokens/s ({rate.source}"
            f"{f', {rate.samples} sample(s)' if rate.samples else ''})"
        )
    return lines


def _status_text(target: str, response: pb.StatusResponse) -> str:
    lines = [
        f"kvrc {response.version} at {target}: reuse {'on' if response.reuse_enabled else 'off'}"
        f"{', warming' if response.warming else ''}, {_child_engines_total(response)} child "
        "engine(s)"
        f", {response.inventory_entries} inventory entries"
    ]
    if response.store and response.store != "memory":
        lines.append(
            f"store {response.store}: "
            + (
                f"UNAVAILABLE, no new grants: {response.store_unavailable_reason}"
                if response.store_unavailable_reason
                else f"ok, {response.remote_child_engines} child engine(s) of other replicas"
            )
        )
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
                "on"
                if s.reuse.enabled
                else _enum_name(pb.ReuseReason, s.reuse.reason, "REUSE_REASON_").lower(),
                f"{child.inventory_entries}{' (stale)' if s.stale else ''}",
                s.not_ready_reason or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
    listed, engines = len(response.child_engines), _child_engines_total(response)
    if listed < engines:
        lines.append(
            f"{listed} of {engines} child engines shown: the answer's share for them is "
            "spent (their endpoint metadata is large)"
        )
    if response.reuse_enabled and response.HasField("cost_model"):
        # The gate decides prefix loads only; with reuse off there is nothing to show.
        lines.extend(_cost_lines(response.cost_model))
    quarantined = sum(1 for x in response.leases if x.state == pb.LEASE_STATE_QUARANTINED)
    shown, total = len(response.leases), _leases_total(response)
    if shown < total:
        lines.append(
            f"{total} lease(s) in flight or quarantined; {shown} of {total} leases shown, "
            f"quarantined first, then by deadline ({quarantined} quarantined shown; "
            "--max-leases N for more)"
        )
    else:
        lines.append(f"{total} lease(s) in flight or quarantined ({quarantined} quarantined)")
    for lease in response.leases:
        doc = lease_document(lease)
        lines.append(
            f"  {doc['lease_id']}  {doc['flow']}  {doc['state']}  "
            f"{doc['source_child_engine_id']} -> {doc['target_child_engine_id'] or '?'}  "
            f"{doc['reason']}"
            + (f"; {lease.prediction.detail}" if lease.HasField("prediction") else "")
        )
    return "\n".join(lines)


def _leases_total(response: pb.StatusResponse) -> int:
    # A coordinator older than leases_total answers 0 there and lists every lease.
    return max(response.leases_total, len(response.leases))


def _child_engines_total(response: pb.StatusResponse) -> int:
    # The same for child_engines_total.
    return max(response.child_engines_total, len(response.child_engines))


# The largest status answer (10,000 leases of ~0.6 KB, StatusRequest.max_leases at its
# limit) is far above grpc's default 4 MiB receive limit.
STATUS_MAX_RECEIVE_BYTES = 64 * MIB


def fetch_status(
    target: str | ChannelOptions, timeout_s: float, max_leases: int = 0
) -> pb.StatusResponse:
    """GetStatus listing at most `max_leases` leases (0: the coordinator's default)."""
    opts = target if isinstance(target, ChannelOptions) else ChannelOptions(target)
    receive = (("grpc.max_receive_message_length", STATUS_MAX_RECEIVE_BYTES),)
    opts = dataclasses.replace(opts, grpc_options=(*opts.grpc_options, *receive))
    with connect_blocking(opts) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        request = pb.StatusRequest(max_leases=max_leases)
        response: pb.StatusResponse = stub.GetStatus(request, timeout=timeout_s)
        return response


def _cmd_status(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        response = fetch_status(channel_options_from_args(args), args.timeout_s, args.max_leases)
    except grpc.RpcError as e:
        name, details = _rpc_error(e)
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


# --- score ---------------------------------------------------------------------


def score_request_from_args(args: argparse.Namespace) -> pb.ScoreRequest:
    """ConfigError (one line, exit 2) for a prompt that cannot be read."""
    request = pb.ScoreRequest(
        scope=pb.ScoreScope(
            model=args.model,
            lora_name=args.lora_name,
            lora_path=args.lora_path,
            cache_salt=args.cache_salt,
            group_idx=args.group_idx,
        ),
        candidate_child_engine_ids=parse_engine_ids(args.candidates),
    )
    try:
        if args.tokens is not None:
            request.token_ids.ids.extend(parse_token_ids(args.tokens, "--tokens"))
        elif args.tokens_file is not None:
            request.token_ids.ids.extend(read_token_ids(args.tokens_file, "--tokens-file"))
        else:
            request.block_hashes.hashes.extend(
                parse_block_hashes(args.block_hashes, "--block-hashes")
            )
            if args.mm_feature:
                raise ValueError("--mm-feature goes with --tokens or --tokens-file")
        for text in args.mm_feature:
            identifier, offset, length = parse_mm_feature(text, "--mm-feature")
            request.token_ids.mm_features.add(identifier=identifier, offset=offset, length=length)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return request


def score_document(response: pb.ScoreResponse) -> dict[str, Any]:
    return {
        "reuse_enabled": response.reuse_enabled,
        "reuse_detail": response.reuse_detail,
        "prediction_basis": response.prediction_basis,
        "engines_left_out": response.engines_left_out,
        "engines": [
            {
                "child_engine_id": e.child_engine_id,
                "scored": e.scored,
                "detail": e.detail,
                "prompt_blocks": e.prompt_blocks,
                "local_matched_blocks": e.local_matched_blocks,
                "local_by_tier": {_tier_name(t.tier): t.blocks for t in e.local_by_tier},
                "loadable_blocks": e.loadable_blocks,
                "holder_child_engine_id": e.holder_child_engine_id,
                "holder_tier": _tier_name(e.holder_tier) if e.holder_child_engine_id else "",
                "predicted_saving_ms": e.predicted_saving_ms,
                "reuse": {
                    "enabled": e.reuse.enabled,
                    "reason": _enum_name(pb.ReuseReason, e.reuse.reason, "REUSE_REASON_"),
                    "detail": e.reuse.detail,
                },
            }
            for e in response.engines
        ],
    }


def _score_text(target: str, response: pb.ScoreResponse) -> str:
    reuse = "on" if response.reuse_enabled else f"off ({response.reuse_detail})"
    left_out = (
        f" ({response.engines_left_out} more not listed: name --candidates)"
        if response.engines_left_out
        else ""
    )
    lines = [
        f"kvrc score at {target}: reuse {reuse}; {len(response.engines)} child engine(s)"
        + left_out,
        f"predicted saving: {response.prediction_basis}",
    ]
    header = (
        "CHILD ENGINE",
        "BLOCKS",
        "LOCAL",
        "BY TIER",
        "LOADABLE",
        "HOLDER",
        "SAVING MS",
        "NOTE",
    )
    rows = [header]
    for e in response.engines:
        tiers = ",".join(f"{_tier_name(t.tier)}:{t.blocks}" for t in e.local_by_tier)
        rows.append(
            (
                e.child_engine_id,
                str(e.prompt_blocks) if e.scored else "-",
                str(e.local_matched_blocks),
                tiers or "-",
                str(e.loadable_blocks),
                e.holder_child_engine_id or "-",
                f"{e.predicted_saving_ms:.1f}",
                e.detail or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
    return "\n".join(lines)


def _cmd_score(args: argparse.Namespace) -> int:
    request = score_request_from_args(args)
    try:
        with connect_blocking(channel_options_from_args(args)) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            response: pb.ScoreResponse = stub.Score(request, timeout=args.timeout_s)
    except grpc.RpcError as e:
        return _rpc_failed("score", args.target, e)
    if args.json:
        print(json.dumps(score_document(response), indent=2, sort_keys=True))
    else:
        print(_score_text(args.target, response))
    return 0


def _rpc_error(e: grpc.RpcError) -> tuple[str, str]:
    """The status name and its details on one line (grpc's own may span several)."""
    if isinstance(e, grpc.Call):
        code, details = e.code(), e.details() or ""
        return code.name if code is not None else "ERROR", " ".join(details.split())
    return "ERROR", " ".join(str(e).split())


def _rpc_failed(command: str, target: str, e: grpc.RpcError) -> int:
    name, details = _rpc_error(e)
    print(f"kvrc {command}: {name} from {target}: {details}", file=sys.stderr)
    return EXIT_UNREACHABLE


def _cmd_drain(args: argparse.Namespace) -> int:
    request = pb.DrainRequest(
        child_engine_id=args.engine, timeout_ms=args.timeout_ms, wait=args.wait
    )
    # A waiting drain lasts up to its timeout plus the abort acknowledgements.
    timeout_s = (args.timeout_ms or 60_000) / 1000 + 30 if args.wait else 10.0
    try:
        with connect_blocking(channel_options_from_args(args)) as channel:
            stub = pb_grpc.AdminServiceStub(channel)
            response: pb.DrainResponse = stub.Drain(request, timeout=timeout_s)
    except grpc.RpcError as e:
        return _rpc_failed("drain", args.target, e)
    doc = {
        "child_engine_ids": list(response.child_engine_ids),
        "leases_remaining": response.leases_remaining,
        "safe_to_stop": response.safe_to_stop,
    }
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        engines = ", ".join(response.child_engine_ids)
        verdict = "safe to stop" if response.safe_to_stop else "NOT safe to stop yet"
        print(f"draining {engines}: {response.leases_remaining} lease(s) remaining, {verdict}")
    return 0 if response.safe_to_stop or not args.wait else EXIT_NOT_SAFE


def _cmd_quarantine_resolve(args: argparse.Namespace) -> int:
    request = pb.ResolveQuarantineRequest(
        lease_id=args.lease_id,
        resolution=pb.QUARANTINE_RESOLUTION_RELEASE,
        operator_note=args.note,
    )
    try:
        with connect_blocking(channel_options_from_args(args)) as channel:
            stub = pb_grpc.AdminServiceStub(channel)
            response: pb.ResolveQuarantineResponse = stub.ResolveQuarantine(request, timeout=10.0)
    except grpc.RpcError as e:
        return _rpc_failed("quarantine resolve", args.target, e)
    state = _enum_name(pb.LeaseState, response.state, "LEASE_STATE_")
    if args.json:
        print(json.dumps({"lease_id": args.lease_id, "state": state}, sort_keys=True))
    else:
        print(f"lease {args.lease_id}: {state} (its pins are released)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (ConfigError, CredentialsError) as e:
        print(f"kvrc: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    return result
