"""How every client reaches kvrc: one `ChannelOptions`, one `connect()`.

    from kvrc.credentials import ChannelOptions, connect

    options = ChannelOptions(
        "kvrc.internal:50051",
        ca_cert=Path("/etc/kvrc/ca.pem"),            # TLS: trust this CA
        client_cert=Path("/etc/kvrc/engine.pem"),     # mutual TLS (optional)
        client_key=Path("/etc/kvrc/engine.key"),
        token_file=Path("/run/secrets/kvrc-token"),   # bearer token (optional)
    )
    session = EngineSession(options, registration)    # or LeaseClient(options, ...), ...

A plain "host:port" string is the plaintext loopback default and behaves as
before. Several kvrc replicas (one shared `--store`): a comma-separated target,
"a:50051,b:50051"; `split_targets` gives one `ChannelOptions` each, and
`EngineSession` moves round robin between them. A plain channel to such a list
is grpc's pick_first over it when every target is an IPv4 literal, else the
first target only (grpc takes one host name per channel).

A token travels as gRPC metadata `authorization: Bearer <token>`; it is read
from its file when a channel is made, and never appears in a `repr()`, a log
line or an error message. It goes over TLS, or in plaintext to a loopback
address only: `connect` refuses (CredentialsError) a token for a plaintext
channel to any other host.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

__all__ = [
    "SESSION_KEEPALIVE",
    "ChannelOptions",
    "CredentialsError",
    "connect",
    "connect_blocking",
    "parse_targets",
    "reconnect_backoff_options",
    "split_targets",
]

log = logging.getLogger("kvrc.credentials")

MAX_FILE_BYTES = 1 << 20
MAX_TOKEN_CHARS = 4096


class CredentialsError(ValueError):
    """Client TLS or token options that cannot work; the message is one line."""


@dataclass(frozen=True, slots=True)
class ChannelOptions:
    target: str  # "host:port"
    # TLS is on when any of tls, ca_cert or client_cert is set (tls alone: system CAs).
    tls: bool = False
    ca_cert: Path | None = None
    client_cert: Path | None = None  # with client_key: mutual TLS
    client_key: Path | None = None
    # Check the server certificate against this name instead of the target's host.
    server_name: str | None = None
    token_file: Path | None = None
    token: str | None = field(default=None, repr=False)  # prefer token_file
    grpc_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise CredentialsError("a client certificate needs its key (client_cert, client_key)")
        if self.token is not None and self.token_file is not None:
            raise CredentialsError("give a token or a token_file, not both")
        if self.token is not None:
            _check_token(self.token, "token")
        if self.server_name is not None and not self.secure:
            raise CredentialsError("server_name only applies with TLS (set ca_cert or tls)")

    @property
    def secure(self) -> bool:
        return self.tls or self.ca_cert is not None or self.client_cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        root = _read_pem(self.ca_cert, "ca_cert") if self.ca_cert is not None else None
        key = cert = None
        if self.client_cert is not None and self.client_key is not None:
            cert = _read_pem(self.client_cert, "client_cert")
            key = _read_pem(self.client_key, "client_key")
            _check_key_pair(self.client_cert, self.client_key)
        return grpc.ssl_channel_credentials(root, key, cert)

    def check_token_transport(self) -> None:
        """CredentialsError when a token would cross a network in plaintext.

        kvrc refuses --auth-tokens on a plaintext non-loopback address; a client must
        not send its token to one either (anyone on the path could replay it)."""
        if self.secure or (self.token is None and self.token_file is None):
            return
        if not _target_is_loopback(self.target):
            raise CredentialsError(
                f"kvrc target {self.target}: a bearer token goes over plaintext to loopback "
                "addresses only; use TLS to reach this host (ca_cert or tls=True; the CLI's "
                "--tls-ca, the vLLM connector's kvrc_ca_cert or kvrc_tls)"
            )

    def bearer_token(self) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_file is None:
            return None
        try:
            raw = self.token_file.read_bytes()[: MAX_TOKEN_CHARS + 2]
        except OSError as e:
            raise CredentialsError(
                f"token file {self.token_file}: cannot read: {e.strerror or e}"
            ) from None
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise CredentialsError(f"token file {self.token_file}: not ASCII") from None
        return _check_token(token, f"token file {self.token_file}")

    def all_grpc_options(self) -> list[tuple[str, Any]]:
        options = list(self.grpc_options)
        if self.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options


def _check_token(token: str, where: str) -> str:
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise CredentialsError(f"{where}: a token is 1..{MAX_TOKEN_CHARS} characters")
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise CredentialsError(f"{where}: a token is printable ASCII without spaces")
    return token


class _EncryptedKey(Exception):
    """Raised by the passphrase callback: an encrypted key asked for a passphrase."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL prompts on the terminal (blocking a service under a tty).
    raise _EncryptedKey


def _check_key_pair(cert: Path, key: Path) -> None:
    """The client key opens without a passphrase and matches its certificate; grpc would
    only say UNAVAILABLE ("Failed to create security handshaker") at every connection."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise CredentialsError(
            f"client_key {key}: encrypted private keys are not supported "
            "(decrypt it, keep it readable only by this client)"
        ) from None
    except ssl.SSLError as e:
        # ssl's reason (e.g. KEY_VALUES_MISMATCH) names no key material.
        raise CredentialsError(
            f"client_cert {cert}, client_key {key}: not a usable certificate and private key "
            f"({e.reason or 'unreadable'})"
        ) from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or type(e).__name__
        raise CredentialsError(
            f"client_cert {cert}, client_key {key}: not a usable certificate and private key "
            f"({reason})"
        ) from None


def is_loopback_host(host: str) -> bool:
    """ "localhost" or a loopback IP: the one rule for what stays on this host (the
    server's --listen address, a client's target for a bearer token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address_host(address: str) -> str:
    """The host of "host:port", "[v6]:port", a bare host or a bare IPv6 address."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    host, sep, _ = address.rpartition(":")
    if not sep or ":" in host:  # no port, or an IPv6 address without brackets
        return address
    return host


def _target_is_loopback(target: str) -> bool:
    """Every address `target` names is on this host (grpc target syntax, or a list)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True  # a unix socket never leaves the host
    if target.startswith(("ipv4:", "ipv6:")):
        addresses = target.partition(":")[2].split(",")
    elif target.startswith("dns:"):
        rest = target.removeprefix("dns:")
        if rest.startswith("//"):  # dns://[authority]/host:port
            rest = rest[2:].partition("/")[2]
        addresses = [rest]
    elif "://" in target:
        return False  # a scheme not parsed here: assume it leaves the host
    else:
        addresses = target.split(",")
    return all(is_loopback_host(_address_host(a.strip())) for a in addresses)


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()[: MAX_FILE_BYTES + 1]
    except OSError as e:
        raise CredentialsError(f"{what} {path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES or b"-----BEGIN " not in data:
        raise CredentialsError(f"{what} {path}: not a PEM file")
    return data


def _as_options(target: str | ChannelOptions) -> ChannelOptions:
    return target if isinstance(target, ChannelOptions) else ChannelOptions(target)


# --- several targets (replicas sharing one store) ---------------------------------------


def parse_targets(value: str | Sequence[str]) -> tuple[str, ...]:
    """ "a:1,b:2" or ["a:1", "b:2"] -> ("a:1", "b:2"); ValueError (one line) when unusable.

    Each is HOST:PORT ("[::1]:50051" for IPv6) or a grpc URI with a scheme
    ("dns:///name:port", "unix:/path"). An empty item, a bad port or a target named
    twice is refused: each is a typo (an unset variable in "$A,$B", a replica listed
    twice while another is missing) that would otherwise silently drop a replica."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("no kvrc target given (an empty string): HOST:PORT[,HOST:PORT...]")
        pieces = value.split(",")
    else:
        pieces = []
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"a kvrc target is a string (HOST:PORT), got {item!r}")
            pieces.extend(item.split(","))
    if not pieces:
        raise ValueError("no kvrc target given: HOST:PORT, or several comma-separated")
    targets: list[str] = []
    for n, raw in enumerate(pieces, 1):
        target = raw.strip()
        if not target:
            raise ValueError(
                f"kvrc targets {value!r}: item {n} is empty (a stray comma or an unset "
                "variable?); give HOST:PORT[,HOST:PORT...]"
            )
        check_target(target)
        targets.append(target)
    _check_distinct(targets)
    return tuple(targets)


def check_target(target: str) -> None:
    """One coordinator target: HOST:PORT ([v6]:PORT), or a grpc URI (dns:, unix:, ...);
    ValueError saying what is wrong."""
    if any(c.isspace() for c in target):
        raise ValueError(f"kvrc target {target!r} has a space in it; give HOST:PORT")
    if "://" in target or target.startswith(("dns:", "unix:", "ipv4:", "ipv6:")):
        return  # a grpc URI: grpc checks it
    host, sep, port = target.rpartition(":")
    if not sep:
        raise ValueError(f"kvrc target {target!r} has no port; give HOST:PORT, e.g. kvrc:50051")
    if not host:
        raise ValueError(f"kvrc target {target!r} has no host; give HOST:PORT, e.g. kvrc:50051")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(
            f"kvrc target {target!r}: an IPv6 address goes in brackets, e.g. [::1]:50051"
        )
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"kvrc target {target!r}: port {port!r} is not a number in 1..65535")


def _check_distinct(targets: Sequence[str]) -> None:
    seen: set[str] = set()
    for target in targets:
        if target in seen:
            raise ValueError(f"kvrc target {target!r} is listed twice; list each replica once")
        seen.add(target)


def split_targets(
    target: str | ChannelOptions | Sequence[str | ChannelOptions],
) -> tuple[ChannelOptions, ...]:
    """One `ChannelOptions` per target; a comma-separated target keeps its credentials.

    A single target without a comma goes to grpc as given, unchecked, as before;
    several are checked as `parse_targets` checks them."""
    given = [target] if isinstance(target, (str, ChannelOptions)) else list(target)
    for item in given:
        if not isinstance(item, (str, ChannelOptions)):
            raise ValueError(f"a kvrc target is HOST:PORT or ChannelOptions, got {item!r}")
    options = [_as_options(item) for item in given]
    if not options:
        raise ValueError("no kvrc target given: HOST:PORT, or several comma-separated")
    if len(options) == 1 and "," not in options[0].target:
        return (options[0],)
    out = [replace(o, target=t) for o in options for t in parse_targets(o.target)]
    _check_distinct([o.target for o in out])
    return tuple(out)


def _grpc_target(target: str) -> str:
    """A plain channel (unary calls) to several targets: grpc's own address list when they
    are IP literals (pick_first, in list order, moves on when one dies), else the first
    one: grpc takes one host name per channel. An engine's lease and lookup calls follow
    its session instead (`clients.session.SessionChannels`)."""
    if "," not in target:
        return target
    targets = parse_targets(target)
    hosts = [t.rpartition(":")[0] for t in targets]
    try:
        if all(ipaddress.ip_address(h).version == 4 for h in hosts):
            return "ipv4:" + ",".join(targets)
    except ValueError:
        pass
    if target not in _warned:
        _warned.add(target)
        log.warning(
            "kvrc targets %r are not all IPv4 literals: this channel reaches %s only",
            target,
            targets[0],
        )
    return targets[0]


_warned: set[str] = set()  # once per target list, not once per channel


# --- asyncio channels (engines) -----------------------------------------------------

if TYPE_CHECKING:  # the stubs are generic, the runtime classes are not
    _AioUnaryUnary = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _AioUnaryStream = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _AioStreamUnary = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _AioStreamStream = grpc.aio.StreamStreamClientInterceptor[Any, Any]
    _SyncUnaryUnary = grpc.UnaryUnaryClientInterceptor[Any, Any]
else:
    _AioUnaryUnary = grpc.aio.UnaryUnaryClientInterceptor
    _AioUnaryStream = grpc.aio.UnaryStreamClientInterceptor
    _AioStreamUnary = grpc.aio.StreamUnaryClientInterceptor
    _AioStreamStream = grpc.aio.StreamStreamClientInterceptor
    _SyncUnaryUnary = grpc.UnaryUnaryClientInterceptor


class _AioBearer:
    """Adds `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<token>)"

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add("authorization", self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _AioBearerUnaryUnary(_AioBearer, _AioUnaryUnary):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _AioBearerUnaryStream(_AioBearer, _AioUnaryStream):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _AioBearerStreamUnary(_AioBearer, _AioStreamUnary):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


class _AioBearerStreamStream(_AioBearer, _AioStreamStream):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


def _bearer_interceptors(token: str) -> list[_AioBearer]:
    return [
        kind(token)
        for kind in (
            _AioBearerUnaryUnary,
            _AioBearerUnaryStream,
            _AioBearerStreamUnary,
            _AioBearerStreamStream,
        )
    ]


# grpc's own reconnect backoff starts at 1 s and grows to 120 s: a channel that saw kvrc
# down for a minute would wait up to 2 minutes after it is back, whatever the client's
# own backoff says. Every channel made here reconnects at most this far apart.
DEFAULT_RECONNECT_BACKOFF_MAX_MS = 2000
RECONNECT_BACKOFF_INITIAL_MS = 100

# HTTP/2 keepalive for long-lived session streams: a frozen or partitioned kvrc (no
# PING ack) breaks the connection even while no write is waiting. kvrc permits a ping
# every 5 s (coordinator/edges/server.py); 10 s keeps clear of its ping strikes.
SESSION_KEEPALIVE: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),  # between sessions too
    ("grpc.http2.max_pings_without_data", 0),  # no cap: heartbeats are sparse data
)


def reconnect_backoff_options(
    max_ms: int = DEFAULT_RECONNECT_BACKOFF_MAX_MS,
) -> tuple[tuple[str, Any], ...]:
    """grpc channel options bounding the channel's reconnect backoff to `max_ms`."""
    max_ms = max(int(max_ms), 1)
    return (
        ("grpc.initial_reconnect_backoff_ms", min(RECONNECT_BACKOFF_INITIAL_MS, max_ms)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
    )


def _channel_options(
    opts: ChannelOptions, grpc_options: Sequence[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """Defaults, then the caller's, then the target's own options: one value per name
    (a repeated channel arg is ambiguous in grpc), the last given winning."""
    merged = dict(reconnect_backoff_options())
    merged.update(grpc_options)
    merged.update(opts.all_grpc_options())
    return list(merged.items())


def connect(
    target: str | ChannelOptions, grpc_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to kvrc: plaintext for a bare target, else as `ChannelOptions` say.

    `grpc_options` (e.g. `SESSION_KEEPALIVE`) add to or replace the defaults (a reconnect
    backoff of at most 2 s); the target's own `ChannelOptions.grpc_options` win over both."""
    opts = _as_options(target)
    # Interceptors add the token to any channel (grpc's own call credentials would refuse
    # a plaintext one): check the transport here, before the token is read.
    opts.check_token_transport()
    token = opts.bearer_token()
    interceptors: Any = _bearer_interceptors(token) if token is not None else None
    options = _channel_options(opts, grpc_options)
    if opts.secure:
        return grpc.aio.secure_channel(
            _grpc_target(opts.target),
            opts.channel_credentials(),
            options,
            interceptors=interceptors,
        )
    return grpc.aio.insecure_channel(_grpc_target(opts.target), options, interceptors=interceptors)


# --- blocking channels (the CLI, tooling) -----------------------------------------------


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: Any) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _SyncBearer(_SyncUnaryUnary):
    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def __repr__(self) -> str:
        return "_SyncBearer(<token>)"

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        metadata = (*(details.metadata or ()), ("authorization", self._header))
        return continuation(_Details(details, metadata), request)


def connect_blocking(target: str | ChannelOptions) -> grpc.Channel:
    """A blocking channel (unary calls) with the same options; close it when done."""
    opts = _as_options(target)
    opts.check_token_transport()  # as in connect(): the interceptor would send it anywhere
    token = opts.bearer_token()
    options = _channel_options(opts)
    if opts.secure:
        channel = grpc.secure_channel(
            _grpc_target(opts.target), opts.channel_credentials(), options
        )
    else:
        channel = grpc.insecure_channel(_grpc_target(opts.target), options)
    if token is not None:
        return grpc.intercept_channel(channel, _SyncBearer(token))
    return channel
