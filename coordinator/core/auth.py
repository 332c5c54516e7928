"""Engine identity and authorization, pure (no grpc, no I/O but reading the file).

With `kvrc serve --auth-tokens FILE` every kvrc.v1 RPC needs a credential: a
bearer token (gRPC metadata `authorization: Bearer <token>`) or, under mutual
TLS, a client certificate whose identity the file names. A credential is bound
to the `engine_id`s it may act for and to roles:

    [[token]]
    name = "prefill-0"          # shown in logs and errors; never the secret
    sha256 = "9f86d08..."       # hex SHA-256 of the token (preferred), or
    # token = "..."             # the token itself (at least 16 characters)
    engine_ids = ["prefill-0"]

    [[token]]
    name = "operator"
    sha256 = "..."
    roles = ["admin"]           # Drain, ResolveQuarantine, GetStatus

    [[identity]]                # a client certificate (mTLS)
    name = "decode-0"
    uri = "spiffe://cluster.local/kvrc/decode-0"   # a SAN entry; or cn = "decode-0"
    engine_ids = ["decode-0"]
    roles = ["read"]            # GetStatus

    [[token]]
    name = "gateway"
    sha256 = "..."
    roles = ["router"]          # Score, and Lookup for any requester: read only

Only SHA-256 digests of tokens are kept in memory; a presented token is hashed,
found by its digest (one dict probe, whatever the number of entries) and compared
with `hmac.compare_digest`. The probe's timing could only tell a caller about the
digest of its guess, not the token: finding a token from that is a SHA-256 preimage.
A child engine belongs to engine E when it is E itself or `E_dp<N>` (vLLM's
naming), or when the registry says so; a file where one credential's engine id
is `E_dp<N>` of another credential's E is refused at load. Refusals are `AuthDenied` (a
`KvrcError`) carrying the `DenyReason` that labels `kvrc_auth_denied_total`;
their messages name the credential by its `name`, never by its secret.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.core.errors import ErrorCode, KvrcError

MIN_TOKEN_CHARS = 16  # about 96 bits in base64: not guessable online
MAX_TOKEN_CHARS = 4096  # above any real token; bounds the hashing work per call
MAX_ENTRIES = 100_000
_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")
_DP_SUFFIX = re.compile(r"_dp[0-9]+")
_DP_CHILD = re.compile(r"(.+)_dp[0-9]+")  # E_dp<N>: the engine E it would belong to


class AuthConfigError(Exception):
    """A credentials file the coordinator cannot start with; the message is one line."""


class Role(enum.Enum):
    ADMIN = "admin"  # Drain, ResolveQuarantine (and everything READ and ROUTER may do)
    READ = "read"  # GetStatus
    # Score, and Lookup for any requester; nothing that changes state (no engine ids:
    # a router cannot open a session, pin, lease, drain or resolve).
    ROUTER = "router"


class DenyReason(enum.Enum):
    """The `reason` label of `kvrc_auth_denied_total`."""

    UNAUTHENTICATED = "unauthenticated"
    FOREIGN_ENGINE = "foreign_engine"
    FOREIGN_LEASE = "foreign_lease"
    NOT_ADMIN = "not_admin"
    NOT_ROUTER = "not_router"
    # A registration whose KV-event endpoint is outside --kv-events-hosts: an engine
    # may not point kvrc's sockets at other services.
    KV_EVENTS_HOST = "kv_events_host"


class AuthDenied(KvrcError):
    """A refusal by the access policy (who calls, or where an engine may point kvrc);
    state is unchanged."""

    def __init__(self, reason: DenyReason, message: str) -> None:
        code = (
            ErrorCode.UNAUTHENTICATED
            if reason is DenyReason.UNAUTHENTICATED
            else ErrorCode.PERMISSION_DENIED
        )
        super().__init__(code, message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a credential's name and what it is bound to (no secret in here)."""

    name: str
    engine_ids: frozenset[str]
    roles: frozenset[Role]
    via: str  # "token" or "certificate"

    def may_read(self) -> bool:
        return bool(self.roles & {Role.ADMIN, Role.READ})

    def may_route(self) -> bool:
        return bool(self.roles & {Role.ADMIN, Role.ROUTER})


@dataclass(frozen=True, slots=True)
class CertIdentity:
    """What the TLS layer verified about the client certificate (empty without mTLS)."""

    common_name: str = ""
    # URI SANs only: an identity's `uri` must not match a DNS or email SAN, which a CA
    # may let requesters choose where it pins the URI (spiffe://...) to the workload.
    uri_sans: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _TokenEntry:
    principal: Principal
    digest: bytes = field(repr=False)  # SHA-256 of the token


@dataclass(frozen=True, slots=True)
class _IdentityEntry:
    principal: Principal
    cn: str
    uri: str


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def child_engine_belongs_to(child_engine_id: str, engine_id: str) -> bool:
    """vLLM's naming: the child of a dense engine is the engine; DP ranks add `_dp<N>`."""
    if child_engine_id == engine_id:
        return True
    return child_engine_id.startswith(engine_id) and bool(
        _DP_SUFFIX.fullmatch(child_engine_id, len(engine_id))
    )


def parse_authorization(values: Sequence[str]) -> str | None:
    """The token of the `authorization` metadata values (None when absent).

    AuthDenied(UNAUTHENTICATED) when malformed: repeated, not `Bearer`, empty or
    oversized. The message never contains the header's value.
    """
    if not values:
        return None
    if len(values) > 1:
        raise AuthDenied(DenyReason.UNAUTHENTICATED, "more than one authorization header")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthDenied(
            DenyReason.UNAUTHENTICATED,
            "the authorization header must be 'Bearer <token>'",
        )
    if len(token) > MAX_TOKEN_CHARS:
        raise AuthDenied(
            DenyReason.UNAUTHENTICATED, f"the bearer token is longer than {MAX_TOKEN_CHARS}"
        )
    return token


class AuthPolicy:
    """The credentials of one coordinator and the checks every RPC makes."""

    def __init__(
        self, tokens: Sequence[_TokenEntry] = (), identities: Sequence[_IdentityEntry] = ()
    ) -> None:
        self._tokens = {entry.digest: entry for entry in tokens}
        self._identities = tuple(identities)
        # Where each cn and uri is first named: a certificate's match is one probe per
        # name it carries, and the file's first matching entry wins.
        self._by_cn: dict[str, int] = {}
        self._by_uri: dict[str, int] = {}
        for index, identity in enumerate(self._identities):
            if identity.cn:
                self._by_cn.setdefault(identity.cn, index)
            if identity.uri:
                self._by_uri.setdefault(identity.uri, index)

    def __repr__(self) -> str:
        return f"AuthPolicy({self.counts()})"

    def counts(self) -> str:
        return f"{len(self._tokens)} token(s), {len(self._identities)} identity(ies)"

    def has_identities(self) -> bool:
        """Entries matched by a client certificate's name (they need mutual TLS)."""
        return bool(self._identities)

    # --- authentication --------------------------------------------------------

    def authenticate(self, token: str | None, cert: CertIdentity) -> Principal:
        """A bearer token wins when present (it must be valid); else the certificate."""
        if token is not None:
            presented = token_digest(token)
            entry = self._tokens.get(presented)
            if entry is None or not hmac.compare_digest(presented, entry.digest):
                raise AuthDenied(DenyReason.UNAUTHENTICATED, "the bearer token is not recognised")
            return entry.principal
        if cert.common_name or cert.uri_sans:
            found = [self._by_uri.get(uri) for uri in cert.uri_sans]
            found.append(self._by_cn.get(cert.common_name) if cert.common_name else None)
            matches = [index for index in found if index is not None]
            if matches:
                return self._identities[min(matches)].principal
            raise AuthDenied(
                DenyReason.UNAUTHENTICATED,
                "the client certificate's identity is not in the credentials file",
            )
        raise AuthDenied(
            DenyReason.UNAUTHENTICATED,
            "credentials required: send 'authorization: Bearer <token>' metadata "
            "or a client certificate",
        )

    # --- authorization ----------------------------------------------------------

    @staticmethod
    def check_session(principal: Principal) -> None:
        """A session carries a rank part of an engine: a credential bound to no engine
        (a router's, an operator's) has none to register."""
        if not principal.engine_ids:
            raise AuthDenied(
                DenyReason.FOREIGN_ENGINE,
                f"credential {principal.name!r} acts for no engine: it may not open a "
                "session (engines register on sessions; routers and operators call the "
                "unary RPCs)",
            )

    @staticmethod
    def check_engine(principal: Principal, engine_id: str) -> None:
        """The principal may register rank parts of `engine_id`."""
        if engine_id not in principal.engine_ids:
            raise AuthDenied(
                DenyReason.FOREIGN_ENGINE,
                f"credential {principal.name!r} may not act for engine {engine_id!r}",
            )

    @staticmethod
    def check_child_engine(
        principal: Principal,
        child_engine_id: str,
        registered_engine_of: Callable[[str], str | None],
        field_name: str = "child_engine_id",
    ) -> None:
        """The principal may act for `child_engine_id` (a registered child's engine wins)."""
        registered = registered_engine_of(child_engine_id)
        if registered is not None:
            allowed = registered in principal.engine_ids
        else:
            allowed = any(child_engine_belongs_to(child_engine_id, e) for e in principal.engine_ids)
        if not allowed:
            raise AuthDenied(
                DenyReason.FOREIGN_ENGINE,
                f"credential {principal.name!r} may not act for {field_name} {child_engine_id!r}",
            )

    @staticmethod
    def check_admin(principal: Principal, method: str) -> None:
        if Role.ADMIN not in principal.roles:
            raise AuthDenied(
                DenyReason.NOT_ADMIN,
                f"{method} needs an admin credential; {principal.name!r} is not one",
            )

    @staticmethod
    def check_router(principal: Principal, method: str) -> None:
        """Score: a read-only router (or admin) credential."""
        if not principal.may_route():
            raise AuthDenied(
                DenyReason.NOT_ROUTER,
                f"{method} needs a credential with the router or admin role; "
                f"{principal.name!r} has neither",
            )

    @staticmethod
    def check_lookup(
        principal: Principal,
        requester_child_engine_id: str,
        registered_engine_of: Callable[[str], str | None],
    ) -> None:
        """Lookup reads for a requester: its own engine, or a router asking for any."""
        if principal.may_route():
            return  # read only: a lookup changes nothing (a router asks for its candidates)
        AuthPolicy.check_child_engine(
            principal, requester_child_engine_id, registered_engine_of, "requester_child_engine_id"
        )

    @staticmethod
    def check_read(principal: Principal, method: str) -> None:
        if not principal.may_read():
            raise AuthDenied(
                DenyReason.NOT_ADMIN,
                f"{method} needs a credential with the read or admin role; "
                f"{principal.name!r} has neither",
            )


# --- the credentials file ---------------------------------------------------------


def load_auth_policy(path: Path) -> AuthPolicy:
    """Reads the TOML credentials file; AuthConfigError (one line, no secret) when bad."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise AuthConfigError(f"auth tokens file {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"auth tokens file {path}: not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message names a line and column, never the value.
        raise AuthConfigError(f"auth tokens file {path}: invalid TOML: {e}") from None
    return parse_auth_policy(data, str(path))


def parse_auth_policy(data: Mapping[str, object], source: str = "auth tokens") -> AuthPolicy:
    unknown = sorted(str(k) for k in data if k not in ("token", "identity"))
    if unknown:
        raise AuthConfigError(
            f"{source}: unknown top-level key(s) {unknown} (expected 'token', 'identity')"
        )
    tokens_raw = _entries(data, "token", source)
    identities_raw = _entries(data, "identity", source)
    if not tokens_raw and not identities_raw:
        raise AuthConfigError(f"{source}: no [[token]] or [[identity]] entry")
    if len(tokens_raw) + len(identities_raw) > MAX_ENTRIES:
        raise AuthConfigError(f"{source}: more than {MAX_ENTRIES} entries")
    names: set[str] = set()
    digests: set[bytes] = set()
    tokens: list[_TokenEntry] = []
    for index, entry in enumerate(tokens_raw):
        where = f"{source}: [[token]] #{index + 1}"
        principal = _principal(entry, where, names, "token", {"token", "sha256"})
        has_token, has_sha = "token" in entry, "sha256" in entry
        if has_token == has_sha:
            raise AuthConfigError(f"{where} ({principal.name}): give exactly one of token, sha256")
        if has_token:
            token = entry["token"]
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                raise AuthConfigError(
                    f"{where} ({principal.name}): token must be a string of at least "
                    f"{MIN_TOKEN_CHARS} characters"
                )
            if len(token) > MAX_TOKEN_CHARS or not (token.isascii() and token.isprintable()):
                raise AuthConfigError(
                    f"{where} ({principal.name}): token must be printable ASCII of at most "
                    f"{MAX_TOKEN_CHARS} characters"
                )
            if " " in token:
                raise AuthConfigError(f"{where} ({principal.name}): token may not contain spaces")
            digest = token_digest(token)
        else:
            sha = entry["sha256"]
            if not isinstance(sha, str) or not _HEX_SHA256.fullmatch(sha.lower()):
                raise AuthConfigError(
                    f"{where} ({principal.name}): sha256 must be 64 hexadecimal digits"
                )
            digest = bytes.fromhex(sha)
        if digest in digests:
            raise AuthConfigError(f"{where} ({principal.name}): the same token is listed twice")
        digests.add(digest)
        tokens.append(_TokenEntry(principal, digest))
    identities: list[_IdentityEntry] = []
    seen_ids: set[tuple[str, str]] = set()
    for index, entry in enumerate(identities_raw):
        where = f"{source}: [[identity]] #{index + 1}"
        principal = _principal(entry, where, names, "certificate", {"cn", "uri"})
        cn, uri = entry.get("cn", ""), entry.get("uri", "")
        if not isinstance(cn, str) or not isinstance(uri, str) or bool(cn) == bool(uri):
            raise AuthConfigError(
                f"{where} ({principal.name}): give exactly one of cn, uri (a non-empty string)"
            )
        if (cn, uri) in seen_ids:
            raise AuthConfigError(f"{where} ({principal.name}): the same identity is listed twice")
        seen_ids.add((cn, uri))
        identities.append(_IdentityEntry(principal, cn, uri))
    principals = [t.principal for t in tokens] + [i.principal for i in identities]
    _refuse_overlapping_engines(principals, source)
    return AuthPolicy(tokens, identities)


def _refuse_overlapping_engines(principals: Sequence[Principal], source: str) -> None:
    """Refuse engine ids of one credential that are DP children (`E_dp<N>`) of another's.

    A credential for E acts for every unregistered `E_dp<N>` (child_engine_belongs_to),
    so E's credential would also cover the other credential's engine whenever it is not
    registered: the two bindings overlap, and neither says which one was meant."""
    owners: dict[str, set[str]] = {}
    for principal in principals:
        for engine_id in principal.engine_ids:
            owners.setdefault(engine_id, set()).add(principal.name)
    for principal in principals:
        for engine_id in sorted(principal.engine_ids):
            match = _DP_CHILD.fullmatch(engine_id)
            if match is None:
                continue
            parent = match.group(1)
            others = sorted(owners.get(parent, set()) - {principal.name})
            if others:
                raise AuthConfigError(
                    f"{source}: engine id {engine_id!r} of credential {principal.name!r} "
                    f"overlaps engine {parent!r} of credential {others[0]!r}: a credential "
                    f"for {parent} also acts for {parent}_dp<N> (vLLM's data-parallel "
                    "children); rename one engine, or bind both to one credential"
                )


def _entries(data: Mapping[str, object], key: str, source: str) -> list[Mapping[str, object]]:
    raw = data.get(key, [])
    if not isinstance(raw, list) or not all(isinstance(e, Mapping) for e in raw):
        raise AuthConfigError(f"{source}: '{key}' must be a list of tables ([[{key}]])")
    return raw


def _principal(
    entry: Mapping[str, object], where: str, names: set[str], via: str, secret_keys: set[str]
) -> Principal:
    unknown = sorted(
        str(k) for k in entry if k not in {"name", "engine_ids", "roles"} | secret_keys
    )
    if unknown:
        raise AuthConfigError(f"{where}: unknown key(s) {unknown}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AuthConfigError(
            f"{where}: name must be 1..128 characters of letters, digits and ._:@/+-"
        )
    if name in names:
        raise AuthConfigError(f"{where}: name {name!r} is used twice")
    names.add(name)
    engine_ids = _strings(entry.get("engine_ids", []), f"{where} ({name}): engine_ids")
    role_names = _strings(entry.get("roles", []), f"{where} ({name}): roles")
    try:
        roles = frozenset(Role(r) for r in role_names)
    except ValueError:
        raise AuthConfigError(
            f"{where} ({name}): roles must be among {[r.value for r in Role]}, got {role_names}"
        ) from None
    if not engine_ids and not roles:
        raise AuthConfigError(f"{where} ({name}): grants nothing (no engine_ids, no roles)")
    if Role.ROUTER in roles and engine_ids:
        # A router's credential sits in a router's config; with engine ids it could open
        # sessions and pin blocks for those engines.
        raise AuthConfigError(
            f"{where} ({name}): a router credential acts for no engine (it may score and "
            f"look up, read only): drop its engine_ids {engine_ids}, or give the engines "
            "their own credential"
        )
    return Principal(name, frozenset(engine_ids), roles, via)


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(
        isinstance(v, str) and v and len(v) <= 256 and v.isascii() and v.isprintable()
        for v in value
    ):
        raise AuthConfigError(f"{where} must be a list of non-empty printable ASCII strings")
    return list(value)


def describe(policy: AuthPolicy | None) -> str:
    """For the startup log line: counts only."""
    return "off" if policy is None else f"on ({policy.counts()})"
