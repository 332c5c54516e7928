"""Lifecycle of one kvrc process, in one place.

uvloop, the grpc.aio server (kvrc services, standard health, reflection), the
Prometheus `/metrics` HTTP server, and graceful shutdown: on SIGTERM/SIGINT
health turns NOT_SERVING, engine sessions end with UNAVAILABLE (engines
reconnect elsewhere), in-flight RPCs get `shutdown_grace_s` to finish, then
the process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from prometheus_client import start_http_server

from coordinator.core.auth import describe as describe_auth
from coordinator.edges.grpc_servicers import add_parsed_service, add_services
from coordinator.edges.grpc_wire import part_codec
from coordinator.edges.tls import server_credentials, warn_of_open_secret_file
from coordinator.edges.zmq_ingest import VllmEventStreams
from coordinator.runtime.config import ConfigError, CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator
from coordinator.runtime.gc_policy import freeze_startup_heap
from coordinator.runtime.log_limit import LEFT_OUT, RateLimitedLog
from coordinator.runtime.peers import PeerLink
from coordinator.runtime.redis_store import RedisStore
from coordinator.runtime.replication import ReplicatedInventory
from kvrc import __version__
from kvrc.credentials import is_loopback_host
from kvrc.v1 import kvrc_pb2 as pb

log = logging.getLogger("kvrc.server")


def _quiet_http_errors(httpd: object, coordinator: Coordinator) -> None:
    """A request that breaks the /metrics server's handler (junk, a 64 KiB path, a peer
    that hangs up mid-answer) is one rate-limited line, not socketserver's traceback."""
    limited = RateLimitedLog(log, coordinator.clock.monotonic_ms)  # one line per 10 s

    def handle_error(request: object, client_address: tuple[str, int]) -> None:
        error = sys.exc_info()[1]
        limited.warning("metrics", "/metrics request from %s failed: %r", client_address[0], error)

    httpd.handle_error = handle_error  # type: ignore[attr-defined]


class _GrpcErrorLines(logging.Filter):
    """grpc's own servicer errors (every service's requests are parsed by kvrc's parser,
    Health's and reflection's too: this is the net for what grpc still raises itself):
    one line per kind per 10 s (`limit`, keyed by grpc's message: an exception type and
    a served method), without the traceback that any client, credentials or not, could
    make grpc print per call."""

    def __init__(self, limit: RateLimitedLog) -> None:
        super().__init__()
        self._limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        left_out = self._limit.admit(str(record.msg)[:200])
        if left_out is None:
            return False
        if left_out:
            record.msg, record.args = record.getMessage() + LEFT_OUT % left_out, None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


# Each read and write of a /metrics connection must progress within this: a client that
# sent half a request and waited held one of the server's threads for good (one thread
# per connection). A client that trickles a byte at a time still holds one meanwhile.
METRICS_REQUEST_TIMEOUT_S = 10.0


def bound_http_requests(httpd: Any, timeout_s: float = METRICS_REQUEST_TIMEOUT_S) -> None:
    """Each /metrics connection's socket reads and writes time out after `timeout_s`."""
    handler = httpd.RequestHandlerClass
    httpd.RequestHandlerClass = type(handler.__name__, (handler,), {"timeout": timeout_s})


SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["EngineService"].full_name,
    pb.DESCRIPTOR.services_by_name["AdminService"].full_name,
    pb.DESCRIPTOR.services_by_name["RouterService"].full_name,
)


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:50051' or '[::1]:50051' -> (host, port); ConfigError otherwise."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"--listen {address!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return host.strip("[]"), int(port_text)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_bindable(host: str, port: int) -> None:
    """Fails early, with one line, where grpc would log a multi-line C-core error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(
            f"--listen {host}:{port}: cannot resolve {host!r} ({e.strerror})"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"--listen {host}:{port}: cannot bind ({e.strerror})") from None


def write_port_file(path: Path, grpc_port: int, metrics_port: int) -> None:
    """Atomically: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"grpc_port": grpc_port, "metrics_port": metrics_port}, f)
    os.replace(tmp, path)


def _server_options(config: CoordinatorConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Two coordinators must not share a port silently.
        ("grpc.so_reuseport", 0),
        # Engines may keep their long-lived sessions alive with pings.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ]


# A KV-event subscription's descriptors (its SUB socket, monitor pair, replay DEALER,
# the publisher's connection; ~5-7 measured), and what sessions, Redis and gRPC take.
FILES_PER_KV_EVENT_STREAM = 8
FILES_BESIDE_STREAMS = 4096


def raise_open_files_limit() -> int:
    """Lifts the soft limit on open files to the hard one (every session, KV-event
    subscription and Redis connection is one or more; 1,024 is a common soft default).
    Returns the limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        log.warning("open files limit stays %d (hard %d): %s", soft, hard, e)
        return soft
    return target


async def run(config: CoordinatorConfig, port_file: Path | None = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status."""
    open_files = raise_open_files_limit()
    wanted = config.max_kv_event_streams * FILES_PER_KV_EVENT_STREAM + FILES_BESIDE_STREAMS
    if 0 <= open_files < wanted:
        log.warning(
            "open files limit %d is below the ~%d that --max-kv-event-streams %d can take "
            "(about %d per subscription, and sessions besides): raise the hard limit "
            "(ulimit -Hn, the container's nofile) or lower the flag",
            open_files,
            wanted,
            config.max_kv_event_streams,
            FILES_PER_KV_EVENT_STREAM,
        )
    host, port = split_host_port(config.listen)
    check_bindable(host, port)
    # Read and check the PEM files before anything starts (ConfigError: one line).
    credentials = server_credentials(config.tls) if config.tls is not None else None
    if config.tls is not None:
        warn_of_open_secret_file("--tls-key", config.tls.key, secret_content=True)
    if credentials is None and not is_loopback_host(host):
        log.warning(
            "plaintext gRPC on %s: anyone on the network can act for any engine; "
            "use --tls-cert/--tls-key and --auth-tokens (docs/security.md)",
            config.listen,
        )
    coordinator, store = coordinator_with_store(config)
    event_streams = VllmEventStreams(coordinator.metrics, max_streams=config.max_kv_event_streams)
    coordinator.inventory.event_streams = event_streams
    server = grpc.aio.server(options=_server_options(config))
    add_services(server, coordinator)
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    grpc_log.addFilter(_GrpcErrorLines(RateLimitedLog(grpc_log, coordinator.clock.monotonic_ms)))
    health = HealthServicer()
    health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    add_parsed_service(server, health, health_service)
    for name in SERVICE_NAMES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    add_parsed_service(
        server,
        ReflectionServicer((*SERVICE_NAMES, health_service.full_name, reflection.SERVICE_NAME)),
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    try:
        if credentials is not None:
            grpc_port = server.add_secure_port(config.listen, credentials)
        else:
            grpc_port = server.add_insecure_port(config.listen)
    except RuntimeError as e:
        raise ConfigError(f"--listen {config.listen}: cannot bind ({e})") from None
    if grpc_port == 0:
        raise ConfigError(f"--listen {config.listen}: cannot bind")

    metrics_port = -1
    httpd = None
    if config.metrics_port >= 0:
        try:
            httpd, _thread = start_http_server(
                config.metrics_port, addr=host, registry=coordinator.metrics.registry
            )
        except OSError as e:
            raise ConfigError(
                f"--metrics-port {config.metrics_port}: cannot bind on {host} ({e.strerror})"
            ) from None
        metrics_port = httpd.server_port
        _quiet_http_errors(httpd, coordinator)
        bound_http_requests(httpd)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Startup objects out of every later GC pass: a full pass over them stalled the
    # loop for tens of ms (coordinator/runtime/gc_policy.py).
    log.debug("froze %d startup objects out of GC passes", freeze_startup_heap())
    await coordinator.start()
    if store is not None:
        await store.start()  # its first read asks the others to announce their parts
    await server.start()
    if port_file is not None:
        write_port_file(port_file, grpc_port, metrics_port)
    log.info(
        "kvrc %s serving on %s, metrics %s, reuse %s, %d declared profile(s), "
        "tls %s, auth %s, store %s",
        __version__,
        _host_port(host, grpc_port),
        f"on http://{_host_port(host, metrics_port)}/metrics" if metrics_port >= 0 else "off",
        "on" if config.reuse else "off",
        len(config.declared_profiles),
        _tls_mode(config),
        describe_auth(config.auth),
        config.store.url,
    )

    await stop.wait()
    log.info("shutting down: grace %.1f s", config.shutdown_grace_s)
    await health.enter_graceful_shutdown()
    # Let health watchers see NOT_SERVING before the server stops answering.
    await asyncio.sleep(0)
    await coordinator.shutdown()
    await event_streams.close()
    if store is not None:
        await store.close()  # after the sessions ended: their departures reach the log
    await server.stop(config.shutdown_grace_s)
    await _let_stragglers_finish(_STRAGGLER_WAIT_S)
    if httpd is not None:
        # The /metrics server notices a shutdown only at its next 0.5 s poll; nothing
        # waits for it (its thread is a daemon): the process exits right after this.
        metrics_server = httpd

        def stop_metrics() -> None:
            metrics_server.shutdown()
            metrics_server.server_close()

        threading.Thread(target=stop_metrics, name="kvrc-metrics-stop", daemon=True).start()
    log.info("stopped")
    return 0


# grpc.aio can return from stop() while an RPC's task is still unwinding a
# cancellation (a Watch the client just cancelled). The event loop's teardown would
# cancel that task again, and grpc logs it as "Exception not handled" with a traceback.
_STRAGGLER_WAIT_S = 1.0


async def _let_stragglers_finish(timeout_s: float) -> None:
    """Give tasks still running after the server stopped a few loop turns to end on
    their own; none is left in the common case, and the wait is bounded."""
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current]
    if left:
        _, pending = await asyncio.wait(left, timeout=timeout_s)
        if pending:
            log.debug("%d task(s) still running at exit", len(pending))


def hash_seed_is_fixed(env: Mapping[str, str]) -> bool:
    """Whether this interpreter was started with a fixed PYTHONHASHSEED (not random)."""
    return env.get("PYTHONHASHSEED", "") not in ("", "random")


def coordinator_with_store(config: CoordinatorConfig) -> tuple[Coordinator, RedisStore | None]:
    """`--store memory`: today's coordinator. A Redis store: the replicated inventory."""
    if config.store.kind == "memory":
        return Coordinator(config), None
    # Unique per process: a restarted replica is a new origin (its old engines expire).
    origin = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    inventory = ReplicatedInventory(
        origin,
        max_entries_total=config.inventory_max_entries_total,
        max_entries_per_engine=config.inventory_max_entries_per_engine,
        outbox_max_bytes=config.store.outbox_max_bytes,
    )
    coordinator = Coordinator(config, inventory=inventory, lease_id_owner=origin)
    store_config = config.store
    if not hash_seed_is_fixed(os.environ) and store_config.snapshot_every_entries:
        # Its block keys are this process's own: a snapshot of them would help no
        # other replica, while its trimming would cut the log they read instead.
        log.warning(
            "PYTHONHASHSEED is not set: this replica writes no snapshots of the shared view "
            "(set one secret value on every replica: docs/operations.md)"
        )
        store_config = dataclasses.replace(store_config, snapshot_every_entries=0)
    store = RedisStore(
        store_config,
        inventory,
        coordinator.clock,
        coordinator.metrics,
        on_applied=coordinator.inventory.refresh_gauges,
        request_full_dumps=coordinator.inventory.request_full_dumps,
        on_epoch=coordinator.use_lease_id_key_secret,
    )
    # Holders and requesters on different replicas (coordinator/runtime/peers.py).
    peers = PeerLink(
        origin,
        inventory.record,
        part_codec(config.bounds),
        coordinator.clock.monotonic_ms,
        inventory.origin_alive,
        claim=store.claim,
        was_silent=inventory.called_silent,
        liveness_known=False,  # until the store has read the log through (`caught_up`)
        epoch_tag=store.epoch_tag,
    )
    inventory.peers = peers
    store.token_floor = peers.highest_token
    coordinator.attach_peers(peers)
    coordinator.leases.store_unavailable = store.unavailable_reason
    coordinator.leases.ledger = store.ledger
    coordinator.store_unavailable = store.unavailable_reason
    log.info("replica %s of the shared store %s", origin, config.store.url)
    return coordinator, store


def _tls_mode(config: CoordinatorConfig) -> str:
    if config.tls is None:
        return "off"
    return "mutual" if config.tls.client_ca is not None else "on"


def serve(config: CoordinatorConfig, port_file: Path | None = None) -> int:
    return uvloop.run(run(config, port_file))
