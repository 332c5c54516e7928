"""Coordinator configuration and the declared-profiles file (TOML or YAML).

A profiles file lists the deployment profiles under which reuse may be
activated. Each entry names the fields it pins (any subset of the profile's
scalar fields):

    [[profile]]
    name = "llama-8b-bf16"
    model = "meta-llama/Llama-3.1-8B-Instruct"
    kv_dtype = "bfloat16"
    block_size = 16

YAML: `profile: [{name: ..., model: ..., ...}]`. A bad file raises
`ConfigError` with one line a person can act on.
"""

from __future__ import annotations

import math
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from coordinator.core.auth import AuthPolicy
from coordinator.core.cost_model import MAX_BLOCK_BYTES, CostConfig, DeclaredLink
from coordinator.core.errors import KvrcError
from coordinator.core.leases import LeaseConfig
from coordinator.core.profiles import DeclaredProfile, declared_profile
from coordinator.core.registry import DEFAULT_MAX_ENDPOINT_BYTES, DEFAULT_MAX_RANK_PARTS
from kvrc.credentials import is_loopback_host
from kvrc.vocabulary import DEFAULT_COORDINATOR


class ConfigError(Exception):
    """A configuration the coordinator cannot start with; the message is one line."""


@dataclass(frozen=True, slots=True)
class FieldBounds:
    """Bounds on what one client message may carry (I8-bad-input)."""

    max_id_chars: int = 256
    max_string_chars: int = 4096  # model names, endpoints, reasons
    max_parallel_size: int = 1024  # each of tp/pp/pcp/dp/dcp
    max_metadata_bytes: int = 1 << 20  # opaque endpoint metadata, all fields together
    max_regions: int = 4096
    # Bytes of one block in one region (K or V of a layer): 1 GiB, past any real layout.
    # Unbounded, a holder's uint64 block_len summed into a prediction overflowed the
    # wire's uint64 and broke other engines' prefix loads and GetStatus (INTERNAL).
    max_block_len: int = MAX_BLOCK_BYTES
    max_extra_entries: int = 64
    max_held_leases: int = 4096
    # Hosts kvrc may subscribe to or bind for a registration's vLLM KV events
    # (`--kv-events-hosts`: networks, names, *.domain); empty: any.
    kv_events_hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the gRPC port's TLS (coordinator/edges/tls.py reads and checks them)."""

    cert: Path
    key: Path
    client_ca: Path | None = None  # set: mutual TLS, clients must present a certificate


# Where the password of a `redis://` / `rediss://` store may come from (never argv).
STORE_PASSWORD_ENV = "KVRC_STORE_PASSWORD"
# Each replica appends a heartbeat op this often (redis_store.py). The origin timeout
# spans four at least: a replica whose own ticks are more than half of it apart takes
# itself for stalled (and re-syncs, calling nobody silent), and a tick is a heartbeat
# plus a Redis round trip, so half of it must be well above one tick (at 1,000 ms
# nearly every tick counted as a stall, and no dead replica ever left the view).
STORE_HEARTBEAT_MS = 500
DEFAULT_ORIGIN_TIMEOUT_MS = 5_000
MIN_ORIGIN_TIMEOUT_MS = 4 * STORE_HEARTBEAT_MS
MAX_ORIGIN_TIMEOUT_MS = 3_600_000  # an hour: a dead replica lingers no longer
# The outbox's byte bound (replication.py). At least one gRPC message (16 MiB): below
# it the ops of one large engine message could overflow the outbox on their own, with
# Redis up, and every overflow costs a reset and full dumps. The wire's bounds keep one
# message's op far below it: 0.6 MB for the largest gRPC batch, about a vLLM frame's
# 4 MiB for ZMQ (tests/runtime/test_replication.py checks a third at most).
DEFAULT_OUTBOX_MAX_BYTES = 128 * 1024 * 1024
MIN_OUTBOX_MAX_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where the state replicas share lives: this process (memory) or one Redis primary.

    `memory` is one coordinator's whole view in process (today's default). A Redis
    store replicates the inventory between replicas (coordinator/runtime/redis_store.py).
    """

    kind: str = "memory"  # "memory" | "redis"
    host: str = ""
    port: int = 6379
    db: int = 0
    tls: bool = False  # rediss://
    username: str | None = None
    # repr=False: a password must never reach a log line or a traceback.
    password: str | None = field(default=None, repr=False)
    tls_ca: Path | None = None  # rediss:// with a private CA
    # A snapshot of the shared view is written after this many log entries, or this
    # long after the newest one, whichever comes first (redis_store.py). 0 = never.
    snapshot_every_entries: int = 100_000
    snapshot_interval_ms: int = 60_000
    # Another replica not heard from this long (its heartbeats in the log, on this
    # replica's monotonic clock) leaves this replica's view, engines and parts.
    origin_timeout_ms: int = DEFAULT_ORIGIN_TIMEOUT_MS
    # The byte bound on ops queued for the log while Redis cannot be reached (replication.py).
    outbox_max_bytes: int = DEFAULT_OUTBOX_MAX_BYTES

    @property
    def url(self) -> str:
        """The URL without credentials: safe to log and to show in `kvrc status`."""
        if self.kind == "memory":
            return "memory"
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"


def parse_store(
    value: str,
    *,
    password: str | None = None,
    tls_ca: Path | None = None,
) -> StoreConfig:
    """`memory`, `redis://host:port/db` or `rediss://host:port/db` -> StoreConfig.

    A password inside the URL is refused: argv is visible to every user of the host
    (`ps`), so it comes from --store-password-file or $KVRC_STORE_PASSWORD.
    """
    if value == "memory":
        if tls_ca is not None:
            raise ConfigError("--store-tls-ca needs a rediss:// store, not --store memory")
        return StoreConfig()
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("redis", "rediss"):
        raise ConfigError(
            f"--store {value!r}: expected memory, redis://HOST:PORT/DB or rediss://HOST:PORT/DB"
        )
    if parsed.password is not None:
        raise ConfigError(
            "--store: a password in the URL would be visible in the process list; "
            f"use --store-password-file or ${STORE_PASSWORD_ENV}"
        )
    if not parsed.hostname:
        raise ConfigError(f"--store {parsed.scheme}://...: the URL names no host")
    try:
        port = parsed.port or 6379
    except ValueError:
        raise ConfigError(f"--store: port of {parsed.netloc!r} must be 1..65535") from None
    path = parsed.path.strip("/")
    if path and not (path.isdigit() and int(path) <= 1_000_000):
        raise ConfigError(f"--store: database {path!r} must be a number (redis://HOST:PORT/0)")
    if parsed.query or parsed.fragment:
        raise ConfigError("--store: the URL takes no query or fragment (TLS: --store-tls-ca)")
    tls = parsed.scheme == "rediss"
    if tls_ca is not None and not tls:
        raise ConfigError("--store-tls-ca needs a rediss:// store (TLS)")
    return StoreConfig(
        kind="redis",
        host=parsed.hostname,
        port=port,
        db=int(path) if path else 0,
        tls=tls,
        username=urllib.parse.unquote(parsed.username) if parsed.username else None,
        password=password,
        tls_ca=tls_ca,
    )


def read_store_password(path: Path | None, env: Mapping[str, str]) -> str | None:
    """The file wins over the environment; one trailing newline is not part of it."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"--store-password-file {path}: cannot read: {e.strerror or e}"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"--store-password-file {path}: not UTF-8 text") from None
        password = text.removesuffix("\n")
        if not password:
            raise ConfigError(f"--store-password-file {path}: the file is empty")
        return password
    return env.get(STORE_PASSWORD_ENV) or None


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    listen: str = DEFAULT_COORDINATOR
    metrics_port: int = 9400  # 0 = any free port; -1 = no metrics HTTP server
    reuse: bool = False  # I1-reuse-off: reuse is off by default
    declared_profiles: tuple[DeclaredProfile, ...] = ()
    # The cost model's priors per class of link (profiles file `[[link]]`).
    declared_links: tuple[DeclaredLink, ...] = ()
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    # A closed stream removes the part at once (not READY); after this grace the
    # part also counts as gone for its leases, unless it came back.
    session_grace_ms: int = 2000
    shutdown_grace_s: float = 5.0
    # gRPC's hard limit per message. Above every field bound, so an oversized
    # field gets our INVALID_ARGUMENT; a message beyond this gets grpc's
    # RESOURCE_EXHAUSTED before any of our code runs.
    max_message_bytes: int = 16 << 20
    # One session's outbound queue; a session that does not read is closed.
    session_queue_size: int = 1024
    # Registered rank parts, and their endpoints' bytes (metadata, extra, regions) over
    # all of them; one engine may hold a quarter of each (coordinator/core/registry.py).
    max_rank_parts: int = DEFAULT_MAX_RANK_PARTS
    max_endpoint_bytes: int = DEFAULT_MAX_ENDPOINT_BYTES
    # vLLM KV-event subscriptions at once (one per child engine naming an endpoint):
    # each costs a few file descriptors; past it an engine registers unsubscribed.
    max_kv_event_streams: int = 1024
    # Inventory caps: stores past them are dropped and counted (inventory.py "Bounds").
    inventory_max_entries_total: int = 50_000_000
    inventory_max_entries_per_engine: int = 5_000_000
    bounds: FieldBounds = FieldBounds()
    # Lease timers and bounds (coordinator/core/leases.py).
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    # None: plaintext (the loopback default); see docs/security.md.
    tls: TlsFiles | None = None
    # None: no credentials needed (today's behaviour); see coordinator/core/auth.py.
    auth: AuthPolicy | None = None
    # Restart recovery (coordinator/core/recovery.py, docs/operations.md): the known child
    # engines are kept here; after a restart kvrc warms until they are back.
    state_file: Path | None = None
    # Warm-up deadline; None: DEFAULT_WARMUP_MS with a state file, no warm-up without.
    warmup_ms: int | None = None
    # A stale stream whose dump does not begin gets its ResyncRequest again: after
    # this delay, doubling up to the max (the engine may have lost the first one).
    resync_retry_initial_ms: int = 1000
    resync_retry_max_ms: int = 30_000
    # memory (one process's view) or a Redis that replicas share (docs/operations.md).
    store: StoreConfig = StoreConfig()
    # Load or recompute (I9-cost-gate, docs/cost_model.md): the gate, its margin, the
    # bound on links kept and the cold defaults.
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        if self.leases.max_grant_payload_bytes > self.max_message_bytes // 2:
            raise ConfigError(
                f"leases.max_grant_payload_bytes ({self.leases.max_grant_payload_bytes}) must "
                f"be at most half of max_message_bytes ({self.max_message_bytes}): a grant "
                "carries more than its descriptors"
            )
        if self.heartbeat_interval_ms <= 0:
            raise ConfigError(
                f"heartbeat interval must be > 0 ms, got {self.heartbeat_interval_ms}"
            )
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ConfigError(
                f"heartbeat timeout ({self.heartbeat_timeout_ms} ms) must exceed the heartbeat "
                f"interval ({self.heartbeat_interval_ms} ms)"
            )
        if self.warmup_ms is not None and not 0 <= self.warmup_ms <= 3_600_000:
            raise ConfigError(f"warm-up must be 0..3600000 ms, got {self.warmup_ms}")
        if not 1 <= self.resync_retry_initial_ms <= self.resync_retry_max_ms <= 3_600_000:
            raise ConfigError(
                f"resync retry must satisfy 1 <= initial ({self.resync_retry_initial_ms} ms) "
                f"<= max ({self.resync_retry_max_ms} ms) <= 3600000"
            )
        if not (math.isfinite(self.shutdown_grace_s) and 0 <= self.shutdown_grace_s <= 3600):
            raise ConfigError(f"shutdown grace must be 0..3600 s, got {self.shutdown_grace_s}")
        if self.session_queue_size < 1:
            # 0 queues nothing, not even the RegisterAck: no engine could ever register.
            raise ConfigError(f"session queue size must be >= 1, got {self.session_queue_size}")
        if self.session_grace_ms < 0:
            raise ConfigError(f"session grace must be >= 0 ms, got {self.session_grace_ms}")
        if self.inventory_max_entries_total < 0 or self.inventory_max_entries_per_engine < 0:
            raise ConfigError("inventory entry caps must be >= 0")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port must be in 0..65535 (or -1), got {self.metrics_port}")
        if (
            self.auth is not None
            and self.auth.has_identities()
            and (self.tls is None or self.tls.client_ca is None)
        ):
            # Without mutual TLS no peer has a certificate name: every identity is dead.
            raise ConfigError(
                "--auth-tokens lists [[identity]] entries (certificate names): they need "
                "mutual TLS (--tls-client-ca, with --tls-cert and --tls-key)"
            )
        if self.auth is not None and self.tls is None:
            host = self.listen.rpartition(":")[0].strip("[]")
            if not is_loopback_host(host):
                # Bearer tokens in plaintext on a network can be read and replayed.
                raise ConfigError(
                    f"--auth-tokens on {self.listen} needs TLS (--tls-cert, --tls-key): "
                    "bearer tokens travel in plaintext otherwise; plaintext is for loopback only"
                )


def load_profiles(path: Path) -> tuple[DeclaredProfile, ...]:
    """Reads declared profiles from a .toml, .yaml or .yml file."""
    return load_declarations(path)[0]


def load_declarations(path: Path) -> tuple[tuple[DeclaredProfile, ...], tuple[DeclaredLink, ...]]:
    """The profiles file's declared profiles and declared links (`[[link]]`)."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"profiles file {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"profiles file {path}: not UTF-8 text") from None
    data: object
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"profiles file {path}: invalid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"profiles file {path}: invalid YAML{line}") from None
    else:
        raise ConfigError(f"profiles file {path}: unknown extension (use .toml, .yaml or .yml)")
    return parse_profiles(data, str(path)), parse_links(data, str(path))


def parse_profiles(data: object, source: str = "profiles") -> tuple[DeclaredProfile, ...]:
    """Validates the parsed document: `{"profile": [{"name": ..., <field>: ...}, ...]}`."""
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a table with a 'profile' list")
    unknown = sorted(str(k) for k in data if k not in ("profile", "link"))
    if unknown:
        raise ConfigError(
            f"{source}: unknown top-level key(s) {unknown} (expected 'profile' or 'link')"
        )
    entries = data.get("profile", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: 'profile' must be a list of tables")
    profiles: list[DeclaredProfile] = []
    names: set[str] = set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{source}: profile #{index + 1} must be a table")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: profile #{index + 1} needs a non-empty string 'name'")
        if name in names:
            raise ConfigError(f"{source}: profile name {name!r} is declared twice")
        names.add(name)
        pinned = {str(k): v for k, v in entry.items() if k != "name"}
        try:
            profiles.append(declared_profile(name, pinned))
        except KvrcError as e:
            raise ConfigError(f"{source}: {e.message}") from None
    return tuple(profiles)


_LINK_KEYS = ("name", "holders", "requesters", "bandwidth_gbps", "latency_ms")


def parse_links(data: object, source: str = "profiles") -> tuple[DeclaredLink, ...]:
    """`[[link]]` tables: the cost model's prior for the pairs they match (first wins).

    [[link]]
    name = "across racks"
    holders = ["prefill-a-*"]     # shell globs over child engine ids
    requesters = ["prefill-b-*"]
    bandwidth_gbps = 0.1
    latency_ms = 5.0
    """
    if not isinstance(data, Mapping):
        return ()
    entries = data.get("link", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: 'link' must be a list of tables")
    links: list[DeclaredLink] = []
    for index, entry in enumerate(entries):
        where = f"{source}: link #{index + 1}"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a table")
        unknown = sorted(str(k) for k in entry if k not in _LINK_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown} (expected {list(_LINK_KEYS)})")
        patterns: dict[str, tuple[str, ...]] = {}
        for key in ("holders", "requesters"):
            value = entry.get(key, ["*"])
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{where}: {key} must be a list of non-empty glob strings")
            patterns[key] = tuple(value)
        numbers: dict[str, float] = {}
        for key in ("bandwidth_gbps", "latency_ms"):
            value = entry.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
            numbers[key] = float(value)
        name = entry.get("name", "")
        try:
            links.append(
                DeclaredLink(
                    holders=patterns["holders"],
                    requesters=patterns["requesters"],
                    bandwidth_bytes_per_s=numbers["bandwidth_gbps"] * 1e9,
                    latency_ms=numbers["latency_ms"],
                    name=str(name),
                )
            )
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return tuple(links)
